"""Online drafter training (train/online.py): features per step, backbone and head in one run."""
import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from dominotree.drafters import load_checkpoint, save_checkpoint
from dominotree.train.batch_decode import BatchDecoder
from dominotree.train.online import OnlineConfig, OnlineTrainer, load_domino, lr_scale, save_drafters

from conftest import random_drafter

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.fixture(scope="module")
def setup(tiny_llama_dir):
    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 60, (int(n),), generator=g).tolist() for n in torch.randint(3, 9, (96,), generator=g)]
    responses = BatchDecoder(model).generate(prompts, 40, set(), temperature=1.0, generator=g)
    seqs = [(np.array(p + r), len(p)) for p, r in zip(prompts, responses)]
    return model, seqs


def trainer(model, tmp_path, seconds=1.0, device="cpu", **kw):
    if device != "cpu":
        model = LlamaForCausalLM.from_pretrained(model.name_or_path, dtype=torch.float32).to(device).eval()
    oc = OnlineConfig(out=str(tmp_path / "run"), seconds=seconds, seqs_per_step=8, anchors_per_seq=6,
                      heldout=16, eval_every=10, log_every=10, lr=3e-3, head_lr=3e-3, **kw)
    return OnlineTrainer(model, random_drafter(True, seed=1), oc)


@pytest.mark.parametrize("device", DEVICES)
def test_training_lowers_held_out_loss_of_backbone_and_head(setup, tmp_path, device):
    model, seqs = setup
    tr = trainer(model, tmp_path, seconds=12.0, device=device)
    before = tr.evaluate(seqs, torch.randperm(len(seqs), generator=torch.Generator().manual_seed(0))[:16].tolist())
    log = tr.run(seqs)
    after = log[-1]
    assert after["final"] and after["step"] > 20
    assert after["held_loss_base"] < before["held_loss_base"] - 0.3
    assert after["held_loss_final"] < before["held_loss_final"] - 0.3
    assert (tmp_path / "run" / "log.jsonl").exists()


@pytest.mark.parametrize("device", DEVICES)
def test_head_loss_sends_no_gradient_into_the_backbone(setup, tmp_path, device):
    model, seqs = setup
    tr = trainer(model, tmp_path, device=device)
    loss_base, loss_final, _, _ = tr.losses(seqs, list(range(8)))
    loss_final.backward()
    assert all(p.grad is None or not p.grad.any() for p in tr.drafter.backbone.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in tr.drafter.head.parameters())
    tr.opt.zero_grad(set_to_none=True)
    loss_base, _, _, _ = tr.losses(seqs, list(range(8)))
    loss_base.backward()                 # negative control: the backbone's own loss does reach it
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in tr.drafter.backbone.parameters())


def test_evaluation_is_repeatable_and_leaves_the_sampler_alone(setup, tmp_path):
    model, seqs = setup
    tr = trainer(model, tmp_path)
    state = tr.gen.get_state()
    a, b = tr.evaluate(seqs, list(range(16))), tr.evaluate(seqs, list(range(16)))
    assert a == b
    assert torch.equal(tr.gen.get_state(), state)


def test_schedule_warms_up_then_decays_to_the_floor():
    oc = OnlineConfig(out="x", seconds=1.0, warmup_frac=0.1, min_lr_frac=0.1)
    assert lr_scale(0.05, oc) == pytest.approx(0.5)
    assert lr_scale(0.1, oc) == pytest.approx(1.0)
    assert lr_scale(1.0, oc) == pytest.approx(0.1)
    assert lr_scale(0.3, oc) > lr_scale(0.6, oc) > lr_scale(0.9, oc)


def test_saved_pair_loads_as_dflash_and_domino(setup, tmp_path):
    model, _ = setup
    dflash0, domino0 = random_drafter(False, seed=2), random_drafter(True, seed=3)
    save_checkpoint(dflash0, tmp_path / "dflash0", dtype=torch.float32)
    save_checkpoint(domino0, tmp_path / "domino0", dtype=torch.float32)
    d = load_domino(tmp_path / "dflash0", tmp_path / "domino0")          # backbone from DFlash, head from Domino
    for k, v in dflash0.backbone.state_dict().items():
        assert torch.equal(d.backbone.state_dict()[k], v)
    for k, v in domino0.head.state_dict().items():
        assert torch.equal(d.head.state_dict()[k], v)
    save_drafters(d, tmp_path / "a", tmp_path / "b")
    a, b = load_checkpoint(tmp_path / "a", pack=False), load_checkpoint(tmp_path / "b", pack=False)
    assert not a.config.is_domino and b.config.is_domino
    for k, v in a.backbone.state_dict().items():
        assert torch.equal(b.backbone.state_dict()[k], v)
    with pytest.raises(ValueError, match="Domino checkpoint"):
        load_domino(tmp_path / "dflash0", None)
