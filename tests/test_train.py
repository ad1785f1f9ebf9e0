"""Training pipeline on the tiny target: data -> features -> DFlash/Domino training -> a drafter
that loads, fits the target, and proposes better than chance."""
import json

import numpy as np

import pytest
import torch

import dominotree as dt
from dominotree.train.blocks import make_batch
from dominotree.train.data import generate_data, read_shards
from dominotree.train.dflash import TrainConfig, train
from dominotree.train.features import FeatureStore, build_feature_store


@pytest.fixture(scope="module")
def tiny_data(tiny_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    generate_data(tiny_target, root / "data", num_prompts=48, shard_size=16, batch_size=16, max_new_tokens=40,
                  sampled_every=3)
    store = build_feature_store(tiny_target, root / "data", root / "feats", layer_ids=[1, 2], topk=4)
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
    # another recipe in the same dir would have resumed these shards as its own, and rewritten meta.json
    meta = (root / "data" / "meta.json").read_text()
    with pytest.raises(ValueError, match="max_new_tokens=40, not max_new_tokens=64"):
        generate_data(tiny_target, root / "data", num_prompts=48, shard_size=16, batch_size=16, max_new_tokens=64,
                      sampled_every=3)
    assert (root / "data" / "meta.json").read_text() == meta and [s.stat().st_mtime_ns for s in shards] == before


def test_features_match_the_target(tiny_target, tiny_data):
    _, store = tiny_data
    toks, feats, plen = store.sequence(5)
    tiny_target.set_taps([1, 2])
    ref = tiny_target.prefill(toks.tolist()).features
    assert torch.allclose(feats.float(), ref.float(), atol=0.05, rtol=0.02)   # stored in bf16


def test_feature_store_grows_with_the_data_without_recomputing_the_old_sequences(tiny_target, tiny_llama_dir, tiny_data,
                                                                                 tmp_path):
    import shutil
    import numpy as np
    from dominotree.train.features import FeatureStore
    root, store = tiny_data
    shards = sorted((root / "data").glob("shard_*.npz"))
    (tmp_path / "data").mkdir()
    for s in shards[:2]:
        shutil.copy(s, tmp_path / "data" / s.name)
    small = build_feature_store(tiny_target, tmp_path / "data", tmp_path / "f", layer_ids=[1, 2], topk=4)
    n_old, old_feats = len(small), np.array(small.feats)
    old_bytes = (tmp_path / "f" / "features.u16").read_bytes()
    # mark the kept prefix: if the grown store recomputed it, the mark would be gone
    marked = bytearray(old_bytes)
    marked[:2] = b"\xff\xff"
    (tmp_path / "f" / "features.u16").write_bytes(bytes(marked))
    shutil.copy(shards[2], tmp_path / "data" / shards[2].name)
    grown = build_feature_store(tiny_target, tmp_path / "data", tmp_path / "f", layer_ids=[1, 2], topk=4)
    assert len(grown) == len(store) > n_old
    assert np.array_equal(grown.offsets, store.offsets) and np.array_equal(grown.tokens, store.tokens)
    assert bytes(np.array(grown.feats[:1]).tobytes()[:2]) == b"\xff\xff"        # kept, not recomputed
    a = int(grown.offsets[n_old])
    assert np.array_equal(np.array(grown.feats[1:a]), old_feats[1:a])
    for i in (n_old, len(store) - 1):                                              # new rows = a full build
        torch.testing.assert_close(grown.sequence(i)[1].float(), store.sequence(i)[1].float(), atol=0.05, rtol=0.02)
        assert torch.equal(grown.topk(i)[0][:, 0], store.topk(i)[0][:, 0])
    assert torch.equal(grown.topk(0)[0], store.topk(0)[0])
    # other taps or another top-k: rebuilt from scratch (the marked value is gone)
    other = build_feature_store(tiny_target, tmp_path / "data", tmp_path / "f", layer_ids=[1, 2], topk=2)
    assert bytes(np.array(other.feats[:1]).tobytes()[:2]) != b"\xff\xff" and other.topk(0)[0].shape[1] == 2
    assert FeatureStore(tmp_path / "f").layer_ids == [1, 2]
    # the target in another dtype (`train features --precision`): rebuilt too, not mixed into the store
    marked = bytearray((tmp_path / "f" / "features.u16").read_bytes())
    marked[:2] = b"\xff\xff"
    (tmp_path / "f" / "features.u16").write_bytes(bytes(marked))
    assert other.target_dtype == "torch.float32"
    bf16 = build_feature_store(dt.load_target(str(tiny_llama_dir), dtype=torch.bfloat16), tmp_path / "data",
                               tmp_path / "f", layer_ids=[1, 2], topk=2)
    assert bf16.target_dtype == "torch.bfloat16" and bytes(np.array(bf16.feats[:1]).tobytes()[:2]) != b"\xff\xff"
    torch.testing.assert_close(bf16.sequence(3)[1].float(), other.sequence(3)[1].float(), atol=0.1, rtol=0.05)


def test_feature_pass_resumes_where_it_stopped(tiny_target, tiny_data, tmp_path):
    """A pass stopped by its time limit leaves no readable store, keeps what it computed, and a second
    call computes only the rest: the result equals a pass in one go; another request starts over."""
    import numpy as np
    root, store = tiny_data
    kw = dict(layer_ids=[1, 2], topk=4, batch_tokens=200)
    f = tmp_path / "f"
    assert build_feature_store(tiny_target, root / "data", f, time_limit_s=0, **kw) is None   # one batch
    assert not (f / "features.json").exists()
    done = np.load(f / "progress.npy")
    assert 0 < done.sum() < len(store)
    feats = np.memmap(f / "features.u16", dtype=np.uint16, mode="r+", shape=store.feats.shape)
    first = int(np.flatnonzero(done)[0])
    a = int(store.offsets[first])
    assert np.array_equal(feats[a], np.asarray(store.feats[a]))      # flushed when it stopped
    feats[a, 0] = 0xFFFF                                              # a mark: gone if recomputed
    feats.flush()
    del feats
    full = build_feature_store(tiny_target, root / "data", f, **kw)
    assert full is not None and not (f / "progress.npy").exists() and not (f / "progress.json").exists()
    assert int(np.asarray(full.feats[a, 0])) == 0xFFFF                # kept, not recomputed
    rest = np.ones(len(store.feats), dtype=bool)
    rest[a] = False
    assert np.array_equal(np.asarray(full.feats)[rest], np.asarray(store.feats)[rest])
    assert np.array_equal(np.asarray(full.topk_ids), np.asarray(store.topk_ids))
    # an unfinished pass of another request (top-2) is not resumed into this one's files
    assert build_feature_store(tiny_target, root / "data", f, time_limit_s=0, **{**kw, "topk": 2}) is None
    again = build_feature_store(tiny_target, root / "data", f, **kw)
    assert int(np.asarray(again.feats[a, 0])) != 0xFFFF and np.array_equal(np.asarray(again.feats),
                                                                            np.asarray(store.feats))


def test_auto_precision_continues_the_pass_the_store_holds(tiny_llama_dir, tiny_target, tiny_data, tmp_path,
                                                           monkeypatch):
    """A pass started in fp32 and stopped is resumed in fp32 by `--precision auto` even where the
    timing would now choose bf16 (the progress is kept, not thrown away); an explicit choice wins."""
    import argparse
    import shutil
    from dominotree.train import pipeline
    from dominotree.train.features import recorded_precision
    root, store = tiny_data
    work = tmp_path / "w"
    shutil.copytree(root / "data", work / "data")
    assert recorded_precision(work / "features") is None
    assert build_feature_store(tiny_target, work / "data", work / "features", layer_ids=[1, 2],
                               batch_tokens=200, time_limit_s=0) is None                     # fp32, one batch
    kept = np.load(work / "features" / "progress.npy").sum()
    assert recorded_precision(work / "features") == "fp32"
    monkeypatch.setattr(pipeline, "resolve_precision", lambda name: "bf16" if name == "auto" else name)
    args = argparse.Namespace(model=str(tiny_llama_dir), workdir=str(work), layers="1,2", topk=0,
                              precision="auto", time_limit=0)
    pipeline.run_features(args)
    assert json.loads((work / "features" / "progress.json").read_text())["target_dtype"] == "torch.float32"
    assert np.load(work / "features" / "progress.npy").sum() > kept                        # resumed
    pipeline.run_features(argparse.Namespace(**{**vars(args), "precision": "bf16"}))
    assert recorded_precision(work / "features") == "bf16"                                # started over
    (work / "features" / "progress.json").write_text("not json")
    assert recorded_precision(work / "features") is None


def test_target_topk_are_the_targets_next_token_log_probs(tiny_target, tiny_data, tmp_path):
    import shutil
    from dominotree.train.features import FeatureStore, build_target_topk
    _, store = tiny_data
    toks, _, _ = store.sequence(5)
    ids, logp = store.topk(5)
    with torch.no_grad():
        ref = torch.log_softmax(tiny_target.model(input_ids=toks[None]).logits[0].float(), -1).topk(4, -1)
    assert torch.equal(ids, ref.indices)
    torch.testing.assert_close(logp, ref.values, atol=2e-3, rtol=1e-3)    # stored in fp16
    # adding the top-k to an existing store (separate pass) gives the same soft labels
    shutil.copytree(store.root, tmp_path / "f")
    for name in ("topk_ids.npy", "topk_logp.npy"):
        (tmp_path / "f" / name).unlink()
    with pytest.raises(ValueError, match="no target top-k"):
        FeatureStore(tmp_path / "f").topk(0)
    added = build_target_topk(tiny_target, FeatureStore(tmp_path / "f"), k=4)
    assert torch.equal(added.topk(5)[0], ids)


def test_blocks_see_only_the_context_before_their_anchor(tiny_data):
    _, store = tiny_data
    g = torch.Generator().manual_seed(0)
    seqs = [store.sequence(i) for i in range(3)]
    b = make_batch(seqs, block_size=4, num_anchors=3, num_depths=4, mask_token_id=3, generator=g,
                   topk=[store.topk(i) for i in range(3)])
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
            # the soft label of depth d is the target's prediction made at position a + d - 1
            ids, logp = store.topk(i)
            assert b.soft_ids[i, n, :len(d_ok)].tolist() == [ids[a + d - 1].tolist() for d in d_ok]
            assert (b.soft_ids[i, n, len(d_ok):] == -1).all()


@pytest.mark.parametrize("head, extra", [(False, {}), (False, {"vocab": "full"}), (True, {}), (True, {"ttt": True}),
                                         (True, {"curriculum": False}), (False, {"distill": 0.7}),
                                         (True, {"distill": 0.5}), (False, {"init_layers": "target"}),
                                         (True, {"precision": "fp32"})])
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


def test_domino_run_continues_a_domino_checkpoint_head_and_all(tiny_target, tiny_data, tmp_path):
    _, store = tiny_data
    kw = dict(seqs_per_step=2, anchors_per_seq=3, num_layers=1, block_size=6, intermediate_size=64, num_heads=4,
              num_kv_heads=2, mask_token_id=3, head=True, shift_label=True, emb_dim=16, gru_hidden_dim=24,
              save_every=5, log_every=5)
    train(tiny_target, store, TrainConfig(out=str(tmp_path / "a"), steps=5, **kw), progress=False)
    # lr 0: the continued run's weights are exactly the checkpoint it started from
    train(tiny_target, store, TrainConfig(out=str(tmp_path / "b"), steps=1, lr=0.0, init_from=str(tmp_path / "a" / "model"),
                                          **kw), progress=False)
    a, b = (dt.load_drafter(str(tmp_path / r / "model"), target=tiny_target) for r in "ab")
    assert torch.equal(a.head.prefix_gru.weight_hh_l0, b.head.prefix_gru.weight_hh_l0)
    assert torch.equal(a.head.embed_proj[0].weight, b.head.embed_proj[0].weight)
    assert torch.equal(a.head.embed_proj[2].weight, b.head.embed_proj[2].weight)   # unseen rows kept too
    with pytest.raises(ValueError, match="does not fit"):
        train(tiny_target, store, TrainConfig(out=str(tmp_path / "c"), steps=1, init_from=str(tmp_path / "a" / "model"),
                                              **{**kw, "gru_hidden_dim": 32}), progress=False)


def test_head_only_run_keeps_the_dflash_backbone_and_learns_the_head(tiny_target, tiny_data, tmp_path):
    _, store = tiny_data
    kw = dict(seqs_per_step=4, anchors_per_seq=6, num_layers=1, block_size=6, intermediate_size=64, num_heads=4,
              num_kv_heads=2, mask_token_id=3, shift_label=True, emb_dim=16, gru_hidden_dim=24, save_every=40,
              log_every=10, lr=3e-3)
    train(tiny_target, store, TrainConfig(out=str(tmp_path / "dflash"), steps=30, **kw), progress=False)
    base = str(tmp_path / "dflash" / "model")
    train(tiny_target, store, TrainConfig(out=str(tmp_path / "head"), steps=40, head=True, init_from=base,
                                          freeze_backbone=True, **kw), progress=False)
    d, h = (dt.load_drafter(str(tmp_path / r / "model"), target=tiny_target) for r in ("dflash", "head"))
    for (name, a), (_, b) in zip(d.backbone.state_dict().items(), h.backbone.state_dict().items()):
        assert torch.equal(a, b), name
    log = [json.loads(l) for l in open(tmp_path / "head" / "log.jsonl")]
    assert all(r["lambda"] == 0.0 for r in log)                       # no curriculum on a frozen base
    assert log[-1]["loss_final"] < log[0]["loss_final"]
    # head_from: the head of one checkpoint on the backbone of another (lr 0: exactly those weights)
    train(tiny_target, store, TrainConfig(out=str(tmp_path / "mix"), steps=1, head=True, init_from=base,
                                          head_from=str(tmp_path / "head" / "model"), **{**kw, "lr": 0.0}),
          progress=False)
    m = dt.load_drafter(str(tmp_path / "mix" / "model"), target=tiny_target)
    assert torch.equal(m.head.embed_proj[2].weight, h.head.embed_proj[2].weight)
    assert torch.equal(m.backbone.fc.weight, d.backbone.fc.weight)
    with pytest.raises(ValueError, match="needs a Domino run with a head"):
        train(tiny_target, store, TrainConfig(out=str(tmp_path / "x"), steps=1, freeze_backbone=True, **kw),
              progress=False)
    with pytest.raises(ValueError, match="has no head"):
        train(tiny_target, store, TrainConfig(out=str(tmp_path / "y"), steps=1, head=True, head_from=base, **kw),
              progress=False)


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
    # only the length (and pause) of a run change when it continues: another recipe is refused
    held = (tmp_path / "r" / "train_config.json").read_text()
    with pytest.raises(ValueError, match="started with lr=0.001, gamma=7.0, not lr=0.0005, gamma=2.0"):
        train(tiny_target, store, TrainConfig(steps=20, lr=5e-4, gamma=2.0, **kw), progress=False)
    assert (tmp_path / "r" / "train_config.json").read_text() == held
    kw["out"] = str(tmp_path / "." / "r")                              # the same dir, spelt otherwise
    train(tiny_target, store, TrainConfig(steps=20, time_limit_s=600, **kw), progress=False)
    assert [json.loads(l)["step"] for l in open(tmp_path / "r" / "log.jsonl")][-1] == 20


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
    # a minimum count keeps exactly the tokens seen that often
    toks, counts = np.unique(np.asarray(store.tokens), return_counts=True)
    k = int(np.median(counts)) + 1
    ids, remap = training_vocab(store, 96, "data", min_count=k)
    assert set(ids.tolist()) == set(toks[counts >= k].tolist()) and 0 < len(ids) < len(toks)
    with pytest.raises(ValueError, match="vocab_min_count"):
        training_vocab(store, 96, "data", min_count=int(counts.max()) + 1)


def test_vocab_top_keeps_the_most_frequent_response_tokens(tiny_data, tmp_path):
    """The cap ranks response tokens only, ties by id, exactly as draft_vocab.py ranks a shard dir."""
    from dominotree.draft_vocab import token_ranking
    from dominotree.train.dflash import response_ranking, training_vocab
    root, store = tiny_data
    ranking = response_ranking(store, 96)
    counts = np.zeros(96, dtype=np.int64)
    for i in range(len(store)):
        toks, _, plen = store.sequence(i)
        counts += np.bincount(toks[plen:].numpy(), minlength=96)
    assert ranking.tolist() == np.argsort(-counts, kind="stable").tolist()
    token_ranking.cache_clear()
    assert ranking.tolist() == token_ranking(str(root / "data"), 96).tolist()   # the same store: the same order
    ids, remap = training_vocab(store, 96, "data", top=10)
    assert sorted(ids.tolist()) == sorted(ranking[:10].tolist()) and (remap >= 0).sum() == 10
    k = 3    # with a minimum count too: the tokens that pass both
    ids, _ = training_vocab(store, 96, "data", min_count=k, top=10)
    assert set(ids.tolist()) == {int(t) for t in ranking[:10] if (np.asarray(store.tokens) == t).sum() >= k}
    with pytest.raises(ValueError, match="vocab_top"):
        training_vocab(store, 96, "data", top=-1)
    with pytest.raises(ValueError, match="vocab_top caps"):
        training_vocab(store, 96, "full", top=10)


def test_labels_outside_the_training_vocabulary_are_ignored(tiny_target, tiny_data, tmp_path):
    from dominotree.train.dflash import label_columns, training_vocab
    _, store = tiny_data
    toks, counts = np.unique(np.asarray(store.tokens), return_counts=True)
    k = int(np.median(counts)) + 1
    ids, remap = training_vocab(store, 96, "data", min_count=k)
    common, rare = int(toks[counts >= k][0]), int(toks[counts < k][0])
    cols = label_columns(torch.tensor([[-100, common, rare, common]]), remap)
    assert cols.tolist() == [[-100, int(remap[common]), -100, int(remap[common])]]
    assert int(ids[cols[0, 1]]) == common
    # a run on the narrower vocabulary trains (finite loss) with the rare labels dropped
    train(tiny_target, store, TrainConfig(out=str(tmp_path / "r"), steps=3, seqs_per_step=4, anchors_per_seq=4,
                                          vocab_min_count=k, negatives=8), progress=False)
    log = [json.loads(l) for l in open(tmp_path / "r" / "log.jsonl")]
    assert log and all(np.isfinite(r["loss"]) and r["loss"] > 0 for r in log)


def test_eval_reports_held_out_tau_per_dataset(tiny_target):
    from conftest import random_drafter
    from helpers import ScriptedDrafter, reference_sequence
    from dominotree.bench.datasets import Prompt
    from dominotree.train.evaluate import comparisons, evaluate, markdown
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
    # per-prompt taus in prompt order, paired across drafters: the comparison is their ratio
    by = {(r["drafter"], r["dataset"]): r for r in rows}
    assert by["oracle", "all"]["taus"] == by["oracle", "a"]["taus"] + by["oracle", "b"]["taus"]
    pairs = {c["dataset"]: c for c in comparisons(rows)}
    assert set(pairs) == {"a", "b", "all"} and all(c["versus"] == "oracle" for c in pairs.values())
    assert pairs["all"]["ratio"] == pytest.approx(tau["random", "all"] / tau["oracle", "all"])
    assert pairs["a"]["ratio"] < 0.5 and pairs["a"]["ci_lo"] <= pairs["a"]["ratio"] <= pairs["a"]["ci_hi"]
    assert "| random | oracle | all | 2 |" in table


def test_target_init_starts_draft_layers_as_the_targets_last_layers(tiny_target):
    from dominotree.train.dflash import drafter_config
    from dominotree.drafters import DFlashBackbone
    from dominotree.train.target_init import init_from_target_layers, target_decoder_layers

    cfg = drafter_config(TrainConfig(out="unused", num_layers=2), tiny_target, [0, 1])
    backbone = DFlashBackbone(cfg)
    assert init_from_target_layers(backbone, tiny_target) == [2, 3]
    layers = target_decoder_layers(tiny_target)
    assert torch.equal(backbone.layers[1].mlp.down_proj.weight, layers[3].mlp.down_proj.weight)
    assert torch.equal(backbone.layers[0].self_attn.q_proj.weight, layers[2].self_attn.q_proj.weight)
    # the first draft layer's context values are the target's own values at that layer, computed
    # from the deepest tapped layer's output
    ids = torch.tensor([[1, 7, 8, 9, 10, 11]])
    hs = tiny_target.model.base_model(input_ids=ids, output_hidden_states=True).hidden_states
    with torch.no_grad():
        feats = torch.cat([hs[1], hs[2]], -1)
        _, v = backbone.context_kv(backbone.project_context(feats), torch.arange(6)[None])[0]
        t = layers[2]
        want = t.self_attn.v_proj(t.input_layernorm(hs[2])).view(1, 6, -1, cfg.head_dim).transpose(1, 2)
    torch.testing.assert_close(v, want)
    # a drafter whose shapes differ from the target's layers is refused clearly
    narrow = DFlashBackbone(drafter_config(TrainConfig(out="unused", num_layers=2, intermediate_size=32),
                                           tiny_target, [0, 1]))
    with pytest.raises(ValueError, match="does not fit target layer"):
        init_from_target_layers(narrow, tiny_target)


def test_soft_ce_is_hard_ce_for_one_hot_labels_and_ignores_dropped_ids():
    from dominotree.train.dflash import soft_ce, weighted_ce
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 4, 10, generator=g)
    labels = torch.randint(10, (2, 3, 4), generator=g)
    labels[0, 0, 2:] = -100
    w = torch.tensor([1.0, 0.5, 0.25, 0.1])
    hard, _ = weighted_ce(logits, labels, w)
    ids = torch.stack([labels.clamp_min(0), torch.full_like(labels, -1)], -1)   # second id dropped
    logp = torch.stack([torch.zeros(labels.shape), torch.full(labels.shape, -0.1)], -1)
    lq = torch.log_softmax(logits, -1)
    torch.testing.assert_close(soft_ce(lq, ids, logp, labels, w), hard)
    # a real two-token target: the loss is the mixture of the two CEs
    ids2 = torch.stack([labels.clamp_min(0), (labels.clamp_min(0) + 1) % 10], -1)
    logp2 = torch.log(torch.tensor([0.75, 0.25])).expand(2, 3, 4, 2)
    other, _ = weighted_ce(logits, torch.where(labels >= 0, ids2[..., 1], labels), w)
    torch.testing.assert_close(soft_ce(lq, ids2, logp2, labels, w), 0.75 * hard + 0.25 * other)


def test_train_all_runs_every_stage_and_bundles_the_drafters(tiny_llama_dir, tiny_target, tmp_path, monkeypatch):
    import argparse
    from dominotree.train import pipeline
    monkeypatch.setenv("DOMINOTREE_CHECKPOINTS", str(tmp_path / "ckpt"))
    monkeypatch.setitem(pipeline.RECIPE, "layer_ids", [1, 2])
    monkeypatch.setattr(pipeline, "STAGES", [(run, trainer, {**o, "steps": 3}, start)
                                             for run, trainer, o, start in pipeline.STAGES])
    args = argparse.Namespace(stage="all", model=str(tiny_llama_dir), workdir=str(tmp_path / "w"), num_prompts=8,
                              grown_prompts=12, max_new_tokens=24)
    assert pipeline.main(args) == 0
    work = tmp_path / "w"
    assert not (work / "features" / "topk_ids.npy").exists()       # no soft labels: the recipe does not distill
    from dominotree.train.precision import resolve_precision
    want = {"bf16": "torch.bfloat16", "fp32": "torch.float32"}[resolve_precision("auto")]
    assert json.loads((work / "features" / "features.json").read_text())["target_dtype"] == want
    assert json.loads((work / "dflash" / "train_config.json").read_text())["precision"] == resolve_precision("auto")
    # each stage starts from the one before it, with its own loss weighting
    for run, _, overrides, start in pipeline.STAGES:
        cfg = json.loads((work / run / "train_config.json").read_text())
        assert cfg["gamma"] == overrides["gamma"] and cfg["steps"] == 3
        assert cfg["init_from"] == (str(work / start / "model") if start else None)
        if "head_from" in overrides:
            assert cfg["head_from"] == str(work / overrides["head_from"] / "model") and cfg["freeze_backbone"]
        assert cfg["vocab_min_count"] == overrides.get("vocab_min_count", 1)
    # the last stages trained on the grown data: its short shard was completed and featurised
    assert len(read_shards(work / "data")) == 12 and len(FeatureStore(work / "features")) > 8
    dflash = dt.load_drafter(str(tmp_path / "ckpt" / "smollm2-135m-dflash"), target=tiny_target)
    domino = dt.load_drafter(str(tmp_path / "ckpt" / "smollm2-135m-domino"), target=tiny_target)
    assert not hasattr(dflash, "head") and hasattr(domino, "head")


def test_a_grown_drafter_starts_as_the_one_it_grows_from(tiny_target, tiny_data, tmp_path):
    """More layers and more taps (train/grow.py): at lr 0 the grown drafter drafts what the small one does."""
    _, store = tiny_data
    kw = dict(seqs_per_step=4, anchors_per_seq=6, block_size=6, intermediate_size=64, num_heads=4, num_kv_heads=2,
              mask_token_id=3, shift_label=True, save_every=40, log_every=10, lr=3e-3)
    train(tiny_target, store, TrainConfig(out=str(tmp_path / "small"), steps=30, num_layers=1, layer_ids=[2], **kw),
          progress=False)
    small = str(tmp_path / "small" / "model")
    train(tiny_target, store, TrainConfig(out=str(tmp_path / "big"), steps=1, num_layers=2, init_from=small,
                                          **{**kw, "lr": 0.0}), progress=False)
    a, b = (dt.load_drafter(str(tmp_path / r / "model"), target=tiny_target, dtype=torch.float32) for r in ("small", "big"))
    assert a.target_layer_ids == [2] and b.target_layer_ids == [1, 2] and len(b.backbone.layers) == 2
    toks, _, plen = store.sequence(3)
    for d in (a, b):
        tiny_target.set_taps(d.target_layer_ids)
        d.reset()
        d.add_context(tiny_target.prefill(toks[:plen].tolist()).features, start=0)
    out_a, out_b = (d.draft(int(toks[plen]), plen, tiny_target) for d in (a, b))
    assert torch.allclose(out_a.base_logits, out_b.base_logits, atol=1e-4, rtol=1e-4)
    # and it learns from there: the new layer's output projections leave zero
    train(tiny_target, store, TrainConfig(out=str(tmp_path / "big2"), steps=10, num_layers=2, init_from=small, **kw),
          progress=False)
    g = dt.load_drafter(str(tmp_path / "big2" / "model"), target=tiny_target)
    assert g.backbone.layers[1].self_attn.o_proj.weight.abs().sum() > 0
    assert g.backbone.layers[1].mlp.down_proj.weight.abs().sum() > 0
    with pytest.raises(ValueError, match="cannot grow 2 draft layers into 1"):
        train(tiny_target, store, TrainConfig(out=str(tmp_path / "x"), steps=1, num_layers=1,
                                              init_from=str(tmp_path / "big" / "model"), **kw), progress=False)
    with pytest.raises(ValueError, match="drops target taps"):
        train(tiny_target, store, TrainConfig(out=str(tmp_path / "y"), steps=1, num_layers=2, layer_ids=[1],
                                              init_from=small, **kw), progress=False)
    with pytest.raises(ValueError, match="precision must be"):
        train(tiny_target, store, TrainConfig(out=str(tmp_path / "p"), steps=1, num_layers=1, precision="fp16", **kw),
              progress=False)
    with pytest.raises(ValueError, match="not in the feature store"):
        train(tiny_target, store, TrainConfig(out=str(tmp_path / "z"), steps=1, num_layers=1, layer_ids=[3], **kw),
              progress=False)


def test_committed_shards_are_reused_not_regenerated(tiny_target, tiny_data, tmp_path, monkeypatch):
    """`seed_dir` shards made with the same recipe are copied; another recipe's are ignored."""
    import shutil
    import dominotree.train.data as data
    root, _ = tiny_data
    seeds = tmp_path / "seeds"
    shutil.copytree(root / "data", seeds)
    (seeds / "shard_00001.npz").unlink()                 # the seed dir lacks one shard: only that one is generated
    made = []
    real = data._generate_batch
    monkeypatch.setattr(data, "_generate_batch", lambda *a, **k: made.append(1) or real(*a, **k))
    kw = dict(num_prompts=48, shard_size=16, batch_size=16, max_new_tokens=40, sampled_every=3)
    generate_data(tiny_target, tmp_path / "out", seed_dir=seeds, **kw)
    assert len(made) == 1                                 # one batch of 16: shard 1 only
    for k in (0, 2):
        assert (tmp_path / "out" / f"shard_0000{k}.npz").read_bytes() == (seeds / f"shard_0000{k}.npz").read_bytes()
    # copies cost nothing, so they happen past the time limit too (generation does not)
    made.clear()
    generate_data(tiny_target, tmp_path / "quick", seed_dir=seeds, time_limit_s=0, **kw)
    assert not made and (tmp_path / "quick" / "shard_00000.npz").is_file()
    again = read_shards(tmp_path / "out")
    assert [s.tokens.tolist() for s in again] == [s.tokens.tolist() for s in read_shards(root / "data")]
    # a different recipe (here max_new_tokens) must not take those shards
    made.clear()
    generate_data(tiny_target, tmp_path / "other", seed_dir=seeds, **{**kw, "max_new_tokens": 20})
    assert len(made) == 3
    # a smaller num_prompts is the same recipe; its last, shorter shard is generated, not copied
    # (as is shard 1, which the seed dir lacks)
    made.clear()
    generate_data(tiny_target, tmp_path / "fewer", seed_dir=seeds, **{**kw, "num_prompts": 40})
    assert len(made) == 2 and len(read_shards(tmp_path / "fewer")) == 40
    # growing the data again completes that short last shard (here a copy of the seed's), keeps the others
    made.clear()
    generate_data(tiny_target, tmp_path / "fewer", seed_dir=seeds, **kw)
    assert not made and len(read_shards(tmp_path / "fewer")) == 48
    assert (tmp_path / "fewer" / "shard_00002.npz").read_bytes() == (seeds / "shard_00002.npz").read_bytes()


@pytest.mark.parametrize("fusion", [False, True])
def test_training_blocks_compute_what_the_drafter_drafts(tiny_target, tiny_data, tmp_path, fusion):
    """The training path (all blocks of a sequence at once, masked) and the inference path (context
    cached up to the root, one block) give the same backbone output, with and without anchor fusion."""
    from dominotree.train.dflash import block_hidden, drafter_config
    _, store = tiny_data
    tc = TrainConfig(out=str(tmp_path / "r"), num_layers=2, block_size=6, intermediate_size=64, num_heads=4,
                     num_kv_heads=2, mask_token_id=3, shift_label=True, anchor_fusion=fusion)
    cfg = drafter_config(tc, tiny_target, store.layer_ids)
    drafter = dt.drafters.build_drafter(cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in drafter.backbone.parameters():    # random everywhere, anchor_proj included
            p.normal_(0, 0.3)
    toks, feats, plen = store.sequence(5)
    batch = make_batch([(toks, feats, plen)], 6, 4, cfg.num_depths, 3, torch.Generator().manual_seed(2))
    embed_w = tiny_target.model.get_input_embeddings().weight.detach()
    batch.ctx_feats = batch.ctx_feats.float()
    with torch.no_grad():
        train_hid = block_hidden(drafter.backbone, batch, embed_w, cfg)       # [1, N, D, h]
    for n in range(4):
        a = int(batch.block_pos[0, n * 6])
        drafter.reset()
        drafter.add_context(feats[:a].float(), start=0)
        hid = drafter.block_hidden(int(toks[a]), a, tiny_target)
        assert torch.allclose(hid, train_hid[0, n], atol=1e-4), n
    if fusion:   # the fused feature matters: another context row before the root changes the block
        drafter.reset()
        drafter.add_context(torch.cat([feats[:a - 1], feats[:1]]).float(), start=0)
        assert not torch.allclose(drafter.block_hidden(int(toks[a]), a, tiny_target), hid, atol=1e-3)


def test_anchor_fusion_grows_from_a_plain_drafter_and_round_trips(tiny_target, tiny_data, tmp_path):
    _, store = tiny_data
    kw = dict(seqs_per_step=4, anchors_per_seq=6, block_size=6, intermediate_size=64, num_heads=4, num_kv_heads=2,
              mask_token_id=3, shift_label=True, save_every=40, log_every=10, num_layers=1)
    train(tiny_target, store, TrainConfig(out=str(tmp_path / "plain"), steps=30, lr=3e-3, **kw), progress=False)
    plain = str(tmp_path / "plain" / "model")
    train(tiny_target, store, TrainConfig(out=str(tmp_path / "f0"), steps=1, lr=0.0, init_from=plain,
                                          anchor_fusion=True, **kw), progress=False)
    train(tiny_target, store, TrainConfig(out=str(tmp_path / "f"), steps=30, lr=3e-3, init_from=plain,
                                          anchor_fusion=True, **kw), progress=False)
    a, b, f = (dt.load_drafter(str(tmp_path / r / "model"), target=tiny_target, dtype=torch.float32)
               for r in ("plain", "f0", "f"))
    cfg = json.loads((tmp_path / "f" / "model" / "config.json").read_text())
    assert cfg["dflash_config"]["anchor_fusion"] is True and b.config.anchor_fusion and not a.config.anchor_fusion
    assert b.backbone.anchor_scale.abs().sum() == 0 and f.backbone.anchor_scale.abs().sum() > 0
    toks, _, plen = store.sequence(3)
    tiny_target.set_taps(a.target_layer_ids)
    feats = tiny_target.prefill(toks[:plen].tolist()).features
    outs = []
    for d in (a, b):
        d.reset()
        d.add_context(feats, start=0)
        outs.append(d.draft(int(toks[plen]), plen, tiny_target).base_logits)
    assert torch.allclose(outs[0], outs[1], atol=1e-4, rtol=1e-4)     # fusion at zero: the same drafts
    prompt = toks[:plen].tolist()
    assert (dt.generate(tiny_target, f, prompt, method="dflash", max_new_tokens=30).token_ids
            == dt.generate(tiny_target, None, prompt, method="ar", max_new_tokens=30).token_ids)
    with pytest.raises(ValueError, match="without anchor fusion"):
        train(tiny_target, store, TrainConfig(out=str(tmp_path / "x"), steps=1, init_from=str(tmp_path / "f" / "model"),
                                              **kw), progress=False)


def test_a_run_stopped_by_its_time_limit_continues_to_the_same_weights(tiny_target, tiny_data, tmp_path):
    _, store = tiny_data
    kw = dict(steps=6, seqs_per_step=2, anchors_per_seq=4, num_layers=1, block_size=4, intermediate_size=64,
              num_heads=4, num_kv_heads=2, mask_token_id=3, head=True, shift_label=True, emb_dim=16,
              gru_hidden_dim=24, save_every=100, log_every=1, lr=3e-3)
    whole = train(tiny_target, store, TrainConfig(out=str(tmp_path / "whole"), **kw), progress=False)
    # a zero time limit stops after every step: six sittings make the same run
    results = [train(tiny_target, store, TrainConfig(out=str(tmp_path / "pieces"), time_limit_s=0, **kw),
                     progress=False) for _ in range(6)]
    assert results[:5] == [None] * 5 and results[5] is not None
    pieces = results[5]
    for (name, a), (_, b) in zip(whole.backbone.state_dict().items(), pieces.backbone.state_dict().items()):
        assert torch.equal(a, b), name
    for (name, a), (_, b) in zip(whole.head.state_dict().items(), pieces.head.state_dict().items()):
        assert torch.equal(a, b), name
    logs = [[json.loads(l)["loss"] for l in open(tmp_path / r / "log.jsonl")] for r in ("whole", "pieces")]
    assert logs[0] == logs[1] and len(logs[0]) == 6


@pytest.mark.parametrize("bad, match", [
    ({"steps": 0}, "steps must be an integer >= 1"), ({"steps": -3}, "steps must be"),
    ({"seqs_per_step": 0}, "seqs_per_step"), ({"anchors_per_seq": 0}, "anchors_per_seq"),
    ({"num_layers": 0}, "num_layers"), ({"block_size": 1}, "block_size"), ({"steps": 2.5}, "steps"),
    ({"lr": -1e-3}, "lr must be a finite number >= 0"), ({"lr": float("nan")}, "lr"),
    ({"gamma": 0.0}, "gamma must be a finite number > 0"), ({"distill": 1.5}, "distill"),
    ({"warmup_frac": 2.0}, "warmup_frac"), ({"clip": 0.0}, "clip"), ({"time_limit_s": -1}, "time_limit_s"),
    ({"pure_draft_prefix_len": 16}, "below block_size"), ({"vocab": "most"}, "vocab must be one of"),
    ({"init_layers": "copy"}, "init_layers must be one of"), ({"layer_ids": [1, 1]}, "distinct"),
    ({"freeze_backbone": True}, "needs a Domino run with a head"),
])
def test_a_bad_training_request_fails_at_once(bad, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(out="unused", **bad)


def test_bad_data_and_feature_requests_fail_before_any_work(tiny_target, tiny_data, tmp_path):
    root, _ = tiny_data
    for bad, match in (({"num_prompts": 0}, "num_prompts"), ({"num_prompts": -5}, "num_prompts"),
                       ({"batch_size": 0}, "batch_size"), ({"temperature": 0.0}, "temperature")):
        with pytest.raises(ValueError, match=match):
            generate_data(tiny_target, tmp_path / "d", **{"num_prompts": 4, **bad})
    assert not (tmp_path / "d").exists()
    # layer ids index the target's layers: -1 would have read the embeddings, 99 an IndexError
    for layers in ([-1], [4], [1, 1], []):
        with pytest.raises(ValueError, match="distinct target layers 0..3"):
            build_feature_store(tiny_target, root / "data", tmp_path / "f", layer_ids=layers)
    with pytest.raises(ValueError, match="topk must be >= 0"):
        build_feature_store(tiny_target, root / "data", tmp_path / "f", layer_ids=[1], topk=-2)
    with pytest.raises(ValueError, match="no training sequences in .*train data"):
        build_feature_store(tiny_target, tmp_path / "no-data", tmp_path / "f", layer_ids=[1])
    assert not (tmp_path / "f").exists()
    with pytest.raises(FileNotFoundError, match="no feature store in .*train features"):
        FeatureStore(tmp_path / "f")
