"""scripts/gpu_train.py's host-side pieces: the answer order, the data files and the split checkpoint."""
import importlib.util
from pathlib import Path

import numpy as np
import torch

from dominotree.drafters import load_checkpoint
from conftest import random_drafter

spec = importlib.util.spec_from_file_location("gpu_train", Path(__file__).resolve().parents[1] / "scripts" / "gpu_train.py")
gpu_train = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_train)


def test_plan_answers_the_unanswered_prompts_greedily_first_then_all_sampled():
    lens = [3, 0, 5, 300, 4, 6]                 # prompt 1 is empty and 3 too long: neither is answered
    prompts = {"offsets": np.concatenate([[0], np.cumsum(lens)])}
    plan = gpu_train.prompt_plan(prompts, answered=2, temperature=0.6, max_prompt=256, seed=0)
    assert plan[:3] == [(2, 0.0), (4, 0.0), (5, 0.0)]
    assert sorted(i for i, _ in plan[3:]) == [0, 2, 4, 5] and {t for _, t in plan[3:]} == {0.6}


def test_data_files_stay_under_the_size_limit_and_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    seqs = [(rng.integers(0, 49152, int(n)), 4, i, 0.0) for i, n in enumerate(rng.integers(20, 400, 300))]
    kept = gpu_train.save_data(seqs, tmp_path, files=2, max_bytes=60_000)
    files = sorted(tmp_path.glob("gen_data_*.npz"))
    assert 0 < kept < len(seqs) and len(files) == 2                  # random tokens do not all fit
    assert all(f.stat().st_size <= 60_000 for f in files)
    back = []
    for f in files:
        z = np.load(f)
        off = z["offsets"]
        back += [(z["tokens"][off[i]:off[i + 1]], int(z["prompt_index"][i])) for i in range(len(off) - 1)]
    assert len(back) == kept
    assert all(np.array_equal(t, seqs[i][0]) and i == seqs[j][2] for j, (t, i) in enumerate(back))


def test_split_checkpoint_merges_back_into_the_domino_drafter(tmp_path):
    drafter = random_drafter(True, seed=4)
    gpu_train.save_split(drafter, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dflash", "domino"]
    from safetensors.torch import load_file
    head_keys = set(load_file(str(tmp_path / "domino" / "head.safetensors")))
    assert head_keys == set(drafter.head.state_dict())           # the head alone: the backbone travels once
    gpu_train.merge_domino(tmp_path / "dflash", tmp_path / "domino", tmp_path / "merged")
    merged = load_checkpoint(tmp_path / "merged", dtype=torch.float32, pack=False)
    for module, ref in ((merged.backbone, drafter.backbone), (merged.head, drafter.head)):
        for k, v in ref.state_dict().items():
            assert torch.equal(module.state_dict()[k], v.to(torch.bfloat16).float()), k
    assert not load_checkpoint(tmp_path / "dflash", pack=False).config.is_domino
