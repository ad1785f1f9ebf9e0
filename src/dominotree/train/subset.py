"""A training subset: a workdir whose data/ holds chosen shards of another workdir's data.

On 2 cores the target's feature pass over all shards takes hours; a subset (the newest shards and a
replay sample of the older ones) lets a continuation train on fresh data after featurising only
those. `train features` and `train dflash|domino` then run on the subset's workdir as on any other."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from .data import shard_path


def parse_shards(spec: str) -> list[int]:
    """'0:101:6,101:124' -> [0, 6, ..., 96, 101, ..., 123]: comma-separated shard ids or Python-style
    start:stop[:step] ranges, kept in the order given; a shard named twice is an error."""
    ids: list[int] = []
    for part in str(spec).split(","):
        part = part.strip()
        try:
            if ":" in part:
                bounds = [int(x) for x in part.split(":")]
                if len(bounds) not in (2, 3) or (len(bounds) == 3 and bounds[2] <= 0):
                    raise ValueError
                ids.extend(range(*bounds))
            else:
                ids.append(int(part))
        except ValueError:
            raise ValueError(f"bad shard spec {part!r} in {spec!r}: use ids or start:stop[:step] ranges") from None
    if not ids or min(ids) < 0:
        raise ValueError(f"shard spec {spec!r} selects no shards or a negative one")
    if len(set(ids)) != len(ids):
        raise ValueError(f"shard spec {spec!r} names a shard twice")
    return ids


def make_subset(source_data: Path, shards: list[int], workdir: Path) -> Path:
    """Copy the chosen shards of `source_data` into workdir/data, renumbered 0.. in the given order.

    Idempotent: a workdir that already holds this selection of the same source is kept (its
    feature store stays valid); one that holds another selection is an error, never overwritten."""
    source_data, data = Path(source_data), Path(workdir) / "data"
    missing = [k for k in shards if not shard_path(source_data, k).is_file()]
    if missing:
        raise FileNotFoundError(f"{source_data} lacks shards {missing[:8]}{' ...' if len(missing) > 8 else ''}: "
                                f"run `dominotree train data` to write them first")
    record = {"source": str(source_data.resolve()), "shards": list(shards)}
    marker = data / "subset.json"
    if marker.is_file():
        held = json.loads(marker.read_text())
        if (held["source"], held["shards"]) != (record["source"], record["shards"]):
            raise ValueError(f"{data} holds another shard subset ({marker}); choose another workdir")
        if held.get("complete"):
            return data
    elif data.exists() and any(data.iterdir()):
        raise ValueError(f"{data} already holds data that is not a shard subset; choose another workdir")
    data.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({**record, "complete": False}, indent=2))   # a stopped copy is redone
    for new, old in enumerate(shards):
        shutil.copyfile(shard_path(source_data, old), shard_path(data, new))
    marker.write_text(json.dumps({**record, "complete": True}, indent=2))
    return data
