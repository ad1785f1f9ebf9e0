"""Checkpoint averaging: the element-wise weighted mean of drafters from one training lineage.

Successive continuations of one drafter (each pass started from the one before) lie in one basin,
and their mean often generalises better than the last of them (weight averaging along a
trajectory, as in SWA/LAWA). This averages the raw safetensors, accumulating in fp32 and storing in
the first checkpoint's dtypes; the config is the first's, so every checkpoint must share it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import save_file

from ..config import output_dir
from ..drafters.checkpoint import read_raw_config, read_state


def average_checkpoints(dirs: list[Path], weights: list[float], out: Path) -> Path:
    """Write the weighted mean of the checkpoints in dirs to out (config.json + model.safetensors)."""
    dirs, out = [Path(d) for d in dirs], Path(out)
    if any(out.resolve() == d.resolve() for d in dirs):     # its weights would be replaced by the mean
        raise ValueError(f"the output {out} is one of the checkpoints averaged; write the mean to another directory")
    if len(dirs) < 2:
        raise ValueError("averaging needs at least two checkpoints")
    if len(weights) != len(dirs):
        raise ValueError(f"{len(weights)} weights for {len(dirs)} checkpoints")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {weights}")
    configs = [read_raw_config(d) for d in dirs]
    for d, cfg in zip(dirs[1:], configs[1:]):
        if cfg != configs[0]:
            diff = sorted(k for k in set(cfg) | set(configs[0]) if cfg.get(k) != configs[0].get(k))
            raise ValueError(f"{d}: config differs from {dirs[0]}'s in {diff}; only one architecture averages")
    states = [read_state(d) for d in dirs]
    first = states[0]
    for d, sd in zip(dirs[1:], states[1:]):
        if sd.keys() != first.keys():
            raise ValueError(f"{d}: tensors {sorted(sd.keys() ^ first.keys())} are not in both checkpoints")
        bad = [k for k in sd if sd[k].shape != first[k].shape]
        if bad:
            raise ValueError(f"{d}: shapes of {bad} differ from {dirs[0]}'s")
    total = float(sum(weights))
    mean = {k: (sum(sd[k].float() * (w / total) for sd, w in zip(states, weights))).to(first[k].dtype)
            for k in first}
    output_dir(out, "the output")
    save_file(mean, out / "model.safetensors", metadata={"format": "pt"})
    shutil.copyfile(dirs[0] / "config.json", out / "config.json")
    (out / "averaged_from.json").write_text(json.dumps(
        {"checkpoints": [str(d) for d in dirs], "weights": list(weights)}, indent=2))
    return out

