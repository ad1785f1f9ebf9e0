"""train/average.py: the weighted mean of drafter checkpoints, loadable, with clear errors."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import dominotree as dt
from dominotree.cli import main as cli_main
from dominotree.drafters import DrafterLoadError, save_checkpoint
from dominotree.train.average import average_checkpoints

from conftest import random_drafter


def _write(tmp_path, name, domino=True, seed=0, dtype=torch.float32, **kw):
    path = tmp_path / name
    save_checkpoint(random_drafter(domino, seed=seed, **kw), path, dtype=dtype)
    return path


def test_the_mean_is_element_wise_weighted_and_loads_as_a_drafter(tmp_path):
    a, b = _write(tmp_path, "a", seed=1), _write(tmp_path, "b", seed=2)
    out = average_checkpoints([a, b], [3.0, 1.0], tmp_path / "mean")
    wa, wb, wm = (load_file(p / "model.safetensors") for p in (a, b, out))
    assert wm.keys() == wa.keys()
    for k in wa:
        torch.testing.assert_close(wm[k], 0.75 * wa[k] + 0.25 * wb[k])
    assert not torch.equal(wm[next(iter(wa))], wa[next(iter(wa))])    # the two seeds differ: a real mean
    assert type(dt.load_drafter(str(out))).__name__ == "DominoDrafter"     # head and backbone both kept
    assert json.loads((out / "averaged_from.json").read_text())["weights"] == [3.0, 1.0]


def test_a_checkpoint_averaged_with_itself_is_unchanged_in_bf16(tmp_path):
    a = _write(tmp_path, "a", seed=3, dtype=torch.bfloat16)
    out = average_checkpoints([a, a], [1.0, 1.0], tmp_path / "mean")
    wa, wm = load_file(a / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(wm[k].dtype == torch.bfloat16 and torch.equal(wm[k], wa[k]) for k in wa)


def test_different_architectures_and_bad_weights_are_refused(tmp_path):
    a = _write(tmp_path, "a", seed=1)
    dflash = _write(tmp_path, "dflash", domino=False)
    with pytest.raises(ValueError, match="config differs"):
        average_checkpoints([a, dflash], [1, 1], tmp_path / "x")
    with pytest.raises(ValueError, match="2 weights for 3"):
        average_checkpoints([a, a, a], [1, 1], tmp_path / "x")
    with pytest.raises(ValueError, match="non-negative"):
        average_checkpoints([a, a], [1, -1], tmp_path / "x")
    with pytest.raises(ValueError, match="at least two"):
        average_checkpoints([a], [1], tmp_path / "x")
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "config.json").write_text((a / "config.json").read_text())
    (tmp_path / "corrupt" / "model.safetensors").write_bytes(b"not a safetensors file" * 4)
    with pytest.raises(DrafterLoadError, match="unreadable"):
        average_checkpoints([a, tmp_path / "corrupt"], [1, 1], tmp_path / "x")
    assert not (tmp_path / "x").exists()         # nothing half-written


def test_the_mean_is_never_written_over_a_checkpoint_it_averages(tmp_path):
    a, b = _write(tmp_path, "a", seed=1), _write(tmp_path, "b", seed=2)
    before = (a / "model.safetensors").read_bytes()
    for out in (a, tmp_path / "." / "a"):
        with pytest.raises(ValueError, match="is one of the checkpoints averaged"):
            average_checkpoints([a, b], [1, 1], out)
    assert (a / "model.safetensors").read_bytes() == before     # it used to hold the mean, then fail
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="a-file is a file, not a directory"):
        average_checkpoints([a, b], [1, 1], tmp_path / "a-file")


def test_the_cli_stage_averages_with_equal_weights_by_default(tmp_path, capsys):
    a, b = _write(tmp_path, "a", seed=1), _write(tmp_path, "b", seed=2)
    rc = cli_main(["train", "average", "--drafters", f"{a},{b}", "--out", str(tmp_path / "mean")])
    assert rc in (0, None)
    wa, wb, wm = (load_file(p / "model.safetensors") for p in (a, b, tmp_path / "mean"))
    for k in wa:
        torch.testing.assert_close(wm[k], 0.5 * wa[k] + 0.5 * wb[k])
    assert cli_main(["train", "average", "--drafters", f"{a}", "--out", str(tmp_path / "m2")]) == 2
    assert "at least two" in capsys.readouterr().err
