"""train/subset.py: a workdir holding chosen shards of another's data (fresh data + a replay sample)."""
import json
import shutil

import numpy as np
import pytest

from dominotree.cli import main
from dominotree.train.data import Sequence, read_shard, read_shards, shard_path, write_shard
from dominotree.train.subset import make_subset, parse_shards


@pytest.fixture()
def source(tmp_path):
    """Six shards of two sequences each; shard k's tokens all start with k (so a copy's origin shows)."""
    data = tmp_path / "src" / "data"
    data.mkdir(parents=True)
    for k in range(6):
        write_shard(shard_path(data, k), [Sequence(np.array([k, 7, 8, 9 + i]), 2, f"s{k}") for i in range(2)])
    return data


def test_parse_shards_reads_ids_and_ranges_in_order():
    assert parse_shards("0:101:6,101:124") == list(range(0, 101, 6)) + list(range(101, 124))
    assert parse_shards("5, 1:3") == [5, 1, 2]
    for bad in ("", "a", "1:2:3:4", "4:2", "0:5:0", "1,1", "0:3,2", "-1"):
        with pytest.raises(ValueError):
            parse_shards(bad)


def test_subset_copies_the_chosen_shards_renumbered_in_order(source, tmp_path):
    data = make_subset(source, [4, 0, 2], tmp_path / "mix")
    assert [p.name for p in sorted(data.glob("shard_*.npz"))] == [f"shard_{k:05d}.npz" for k in range(3)]
    got = read_shards(data)
    want = [s for k in (4, 0, 2) for s in read_shard(shard_path(source, k))]
    assert [s.tokens.tolist() for s in got] == [s.tokens.tolist() for s in want]
    assert [s.source for s in got] == ["s4", "s4", "s0", "s0", "s2", "s2"]


def test_subset_is_kept_when_asked_again_and_never_overwritten_by_another(source, tmp_path):
    data = make_subset(source, [1, 3], tmp_path / "mix")
    stamps = [p.stat().st_mtime_ns for p in sorted(data.glob("shard_*.npz"))]
    make_subset(source, [1, 3], tmp_path / "mix")
    assert [p.stat().st_mtime_ns for p in sorted(data.glob("shard_*.npz"))] == stamps     # nothing recopied
    with pytest.raises(ValueError, match="another shard subset"):
        make_subset(source, [1, 4], tmp_path / "mix")
    assert read_shard(shard_path(data, 1))[0].tokens[0] == 3                              # untouched
    other = tmp_path / "copy" / "data"
    shutil.copytree(source, other)
    with pytest.raises(ValueError, match="another shard subset"):
        make_subset(other, [1, 3], tmp_path / "mix")          # the same ids of another source
    with pytest.raises(ValueError, match="not a shard subset"):
        make_subset(source, [1], source.parent)        # a workdir with its own data stays as it is
    with pytest.raises(FileNotFoundError, match=r"lacks shards \[9\]"):
        make_subset(source, [0, 9], tmp_path / "other")


def test_a_stopped_copy_is_redone(source, tmp_path):
    data = tmp_path / "mix" / "data"
    data.mkdir(parents=True)
    (data / "subset.json").write_text(json.dumps({"source": str(source), "shards": [2, 5], "complete": False}))
    write_shard(shard_path(data, 0), [Sequence(np.array([99, 99, 99]), 1, "torn")])
    make_subset(source, [2, 5], tmp_path / "mix")
    assert [s.tokens[0] for s in read_shards(data)] == [2, 2, 5, 5]
    assert json.loads((data / "subset.json").read_text())["complete"]


def test_subset_from_the_cli(source, tmp_path, capsys):
    assert main(["train", "subset", "--workdir", str(source.parent), "--shards", "3:6", "--out", str(tmp_path / "m")]) == 0
    assert [s.tokens[0] for s in read_shards(tmp_path / "m" / "data")] == [3, 3, 4, 4, 5, 5]
    capsys.readouterr()
    assert main(["train", "subset", "--workdir", str(source.parent), "--shards", "2,2", "--out", str(tmp_path / "n")]) != 0
    assert "names a shard twice" in capsys.readouterr().err
