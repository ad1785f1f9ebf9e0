"""Training pipeline on the tiny target: data -> features -> DFlash/Domino training -> a drafter
that loads, fits the target, and proposes better than chance."""
import json

import pytest
import torch

import dominotree as dt
from dominotree.train.blocks import make_batch
from dominotree.train.data import generate_data, read_shards
from dominotree.train.dflash import TrainConfig, train
from dominotree.train.features import build_feature_store


@pytest.fixture(scope="module")
def tiny_data(tiny_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    generate_data(tiny_target, root / "data", num_prompts=48, shard_size=16, batch_size=16, max_new_tokens=40,
                  sampled_every=3)
    store = build_feature_store(tiny_target, root / "data", root / "feats", layer_ids=[1, 2])
    return root, store


def test_data_is_resumable_and_compact(tiny_target, tiny_data):
    root, _ = tiny_data
    shards = sorted((root / "data").glob("shard_*.npz"))
    assert len(shards) == 3
    before = [s.stat().st_mtime_ns for s in shards]
    generate_data(tiny_target, root / "data", num_prompts=48, shard_size=16, batch_size=16, max_new_tokens=40,
                  sampled_every=3)
    assert [s.stat().st_mtime_ns for s in shards] == before       # nothing regenerated
    seqs = read_shards(root / "data")
    assert len(seqs) == 48
    assert any(s.source.endswith("/sampled") for s in seqs)
    # greedy responses are the target's own greedy continuations
    s = next(s for s in seqs if not s.source.endswith("/sampled"))
    r = dt.generate(tiny_target, None, s.tokens[:s.prompt_len].tolist(), method="ar", max_new_tokens=40)
    assert r.token_ids == s.tokens[s.prompt_len:].tolist()


def test_features_match_the_target(tiny_target, tiny_data):
    _, store = tiny_data
    toks, feats, plen = store.sequence(5)
    tiny_target.set_taps([1, 2])
    ref = tiny_target.prefill(toks.tolist()).features
    assert torch.allclose(feats.float(), ref.float(), atol=0.05, rtol=0.02)   # stored in bf16


def test_blocks_see_only_the_context_before_their_anchor(tiny_data):
    _, store = tiny_data
    g = torch.Generator().manual_seed(0)
    seqs = [store.sequence(i) for i in range(3)]
    b = make_batch(seqs, block_size=4, num_anchors=3, num_depths=4, mask_token_id=3, generator=g)
    S = b.ctx_feats.shape[1]
    for i, (toks, _, plen) in enumerate(seqs):
        for n in range(3):
            a = int(b.block_pos[i, n * 4])
            assert a >= plen and b.block_ids[i, n * 4] == toks[a]
            row = b.mask[i, 0, n * 4]
            assert row[:a].all() and not row[a:S].any()
            assert row[S + n * 4:S + n * 4 + 4].all() and row[S:].sum() == 4
            d_ok = [d for d in range(1, 5) if a + d < len(toks)]
            assert b.labels[i, n, :len(d_ok)].tolist() == [int(toks[a + d]) for d in d_ok]


@pytest.mark.parametrize("head, extra", [(False, {}), (False, {"vocab": "full"}), (True, {}), (True, {"ttt": True}),
                                         (True, {"curriculum": False})])
def test_training_learns_and_saves_a_loadable_drafter(tiny_target, tiny_data, tmp_path, head, extra):
    _, store = tiny_data
    tc = TrainConfig(out=str(tmp_path / "run"), steps=60, seqs_per_step=4, anchors_per_seq=6, lr=3e-3,
                     num_layers=1, block_size=6, intermediate_size=128, num_heads=4, num_kv_heads=2,
                     mask_token_id=3, head=head, shift_label=head, emb_dim=16, gru_hidden_dim=24,
                     save_every=30, log_every=10, **extra)
    train(tiny_target, store, tc, progress=False)
    log = [json.loads(l) for l in open(tmp_path / "run" / "log.jsonl")]
    assert log[-1]["loss"] < 0.7 * log[0]["loss"]
    assert (tmp_path / "run" / "loss.png").is_file()
    drafter = dt.load_drafter(str(tmp_path / "run" / "model"), target=tiny_target)
    assert hasattr(drafter, "head") == head
    method = "domino" if head else "dflash"
    prompt = store.sequence(0)[0][:store.sequence(0)[2]].tolist()
    plain = dt.generate(tiny_target, None, prompt, method="ar", max_new_tokens=30)
    out = dt.generate(tiny_target, drafter, prompt, method=method, max_new_tokens=30)
    assert out.token_ids == plain.token_ids
    assert out.stats["tau"] > 1.3


def test_training_resumes(tiny_target, tiny_data, tmp_path):
    _, store = tiny_data
    kw = dict(out=str(tmp_path / "r"), seqs_per_step=2, anchors_per_seq=4, num_layers=1, block_size=4,
              intermediate_size=64, num_heads=4, num_kv_heads=2, mask_token_id=3, save_every=5, log_every=5)
    train(tiny_target, store, TrainConfig(steps=5, **kw), progress=False)
    train(tiny_target, store, TrainConfig(steps=10, **kw), progress=False)
    log = [json.loads(l) for l in open(tmp_path / "r" / "log.jsonl")]
    assert [r["step"] for r in log] == [5, 10]
    # a run stopped after logging step 15 but before saving it resumes at 10 and logs 15 once
    with open(tmp_path / "r" / "log.jsonl", "a") as f:
        f.write(json.dumps({"step": 15, "loss": 0.0}) + "\n")
    train(tiny_target, store, TrainConfig(steps=15, **kw), progress=False)
    log = [json.loads(l) for l in open(tmp_path / "r" / "log.jsonl")]
    assert [r["step"] for r in log] == [5, 10, 15] and log[-1]["loss"] > 0


def test_training_vocab_is_the_data_tokens(tiny_data):
    from dominotree.train.dflash import training_vocab
    _, store = tiny_data
    ids, remap = training_vocab(store, 96, "data")
    seen = set(int(t) for t in store.tokens)
    assert 0 < len(seen) < 96 and set(ids.tolist()) == seen
    assert all(int(ids[remap[t]]) == t for t in seen)
    assert (remap[[t for t in range(96) if t not in seen]] == -1).all()
    assert training_vocab(store, 96, "full")[0].tolist() == list(range(96))
    with pytest.raises(ValueError, match="vocab"):
        training_vocab(store, 96, "top")


def test_eval_reports_held_out_tau_per_dataset(tiny_target):
    from conftest import random_drafter
    from helpers import ScriptedDrafter, reference_sequence
    from dominotree.bench.datasets import Prompt
    from dominotree.train.evaluate import evaluate, markdown
    prompts = [Prompt("a", "a0", "x", "Tell me a story."), Prompt("b", "b0", "y", "Count to ten.")]
    base = random_drafter(False, seed=3)
    # an oracle for the first prompt only: right everywhere there, wrong on the second
    ref, _ = reference_sequence(tiny_target, tiny_target.encode_prompt(prompts[0].text), 40)
    rows = evaluate(tiny_target, {"oracle": ScriptedDrafter(base, ref), "random": base}, prompts,
                    max_new_tokens=24, progress=False)
    tau = {(r["drafter"], r["dataset"]): r["tau"] for r in rows}
    assert {r["method"] for r in rows} == {"dflash"}
    assert tau["oracle", "a"] > 4 and tau["oracle", "a"] > tau["oracle", "b"]
    assert tau["random", "a"] < 2
    assert abs(tau["oracle", "all"] - (tau["oracle", "a"] + tau["oracle", "b"]) / 2) < 1e-9
    table = markdown(rows)
    assert "| oracle | dflash |" in table and "| random | dflash |" in table
