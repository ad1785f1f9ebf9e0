"""The compiled Domino chain: the full-vocabulary argmax chain (against a brute-force loop and the
Python chain's unpruned reference), compact draft-vocabulary columns, ties, the fallback, and
lossless generation with it."""
import shutil

import pytest
import torch

import dominotree as dt
from conftest import random_drafter
from test_native import refuse_fallback
from test_trees import random_problem
from dominotree.drafters.domino import W2Bound
from dominotree.trees.chain import domino_chain
from dominotree.trees.fast import HeadWeights
from dominotree.trees.native import chain as native_chain

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler: the native chain cannot be built here")


@pytest.fixture
def native_only(monkeypatch):
    """Fail a test whose chain falls back to the Python chain."""
    refuse_fallback(monkeypatch, native_chain, "domino_chain", "chain")


def brute_force_chain(head, base, hidden, embed, root, prefix_len, ids=None):
    """Depth by depth: argmax (first maximum) of base + W2 SiLU(W1 [H; S]) over the columns, the GRU
    stepped on the chosen token, everything from the head's own modules."""
    state = head.gru_step(head.zero_state(1), embed[[root]])
    tokens = []
    for d in range(base.shape[0]):
        logits = base[d]
        if d >= prefix_len:
            corr = head.correction(hidden[d][None], state)[0]
            logits = logits + (corr if ids is None else corr[ids])
        col = int(torch.argmax(logits))
        tokens.append(col if ids is None else int(ids[col]))
        state = head.gru_step(state, embed[[tokens[-1]]])
    return tokens


def run_native(head, base, hidden, embed, root, prefix_len, ids=None, topm=8, k=16):
    return native_chain.chain_columns(base, hidden, ids, HeadWeights(head), W2Bound(head.embed_proj[2].weight, k=k),
                                      embed, root, prefix_len, base.shape[0], topm)


@pytest.mark.parametrize("seed", range(60))
def test_native_chain_is_the_full_vocabulary_argmax(seed, native_only):
    g = torch.Generator().manual_seed(seed)
    V = [40, 300, 4096][seed % 3]
    head, base, hidden, embed = random_problem(seed, V=V, D=1 + seed % 9, scale=[0.5, 2.0, 6.0][seed % 3])
    prefix_len, root = seed % 3, int(torch.randint(V, (1,), generator=g))
    ids = None
    if seed % 2:                                   # compact columns of a draft vocabulary
        ids = torch.randperm(V, generator=g)[:V // 3].sort().values
        base = base[:, ids]
    with torch.no_grad():
        tokens, logps, scored = run_native(head, base, hidden, embed, root, prefix_len, ids, topm=[1, 8, 64][seed % 3],
                                           k=[0, 4, 16][seed // 3 % 3])
        assert tokens == brute_force_chain(head, base, hidden, embed, root, prefix_len, ids)
    assert logps.shape == (base.shape[0],) and (logps <= 1e-6).all()
    assert (scored[prefix_len:] >= 1).all() and (scored <= base.shape[1]).all()


def test_native_chain_prunes_and_breaks_exact_ties_low(native_only):
    """A duplicated W2 row with an equal base logit at two columns: both score the same, and the
    lower token wins, as torch.argmax over the full vector picks it. With small corrections only a
    few columns are scored exactly."""
    head, base, hidden, embed = random_problem(3, V=3000, D=4, scale=4.0)
    with torch.no_grad():
        w2 = head.embed_proj[2].weight
        w2.mul_(0.02)
        w2[1207] = w2[1105]
        base[:, 1105] = base[:, 1207] = base.max() + 3.0
        tokens, _, scored = run_native(head, base, hidden, embed, 11, prefix_len=1)
        assert tokens == brute_force_chain(head, base, hidden, embed, 11, 1) == [1105] * 4
    assert (scored[1:] < 3000 // 20).all()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("topm", [2, 96])
def test_native_chain_equals_the_python_chain(tiny_target, seed, topm, native_only):
    """On a random drafter's draft: the Python chain's unpruned reference, tokens and labels."""
    d = random_drafter(True, seed=seed)
    tiny_target.set_taps(d.target_layer_ids)
    d.reset()
    d.add_context(tiny_target.prefill([1, 5, 6, 7]).features, 0)
    out = d.draft(9, 4, tiny_target)
    ref = domino_chain(d, out, 9, tiny_target, d.num_depths, topm=topm, pruned=False)
    nat = native_chain.domino_chain_native(d, out, 9, tiny_target, d.num_depths, topm=topm)
    assert torch.equal(nat.tokens, ref.tokens) and torch.equal(nat.parents, ref.parents)
    finite = torch.isfinite(ref.scores)
    assert torch.equal(finite, torch.isfinite(nat.scores))
    assert torch.allclose(nat.scores[finite], ref.scores[finite], atol=1e-4)


def test_the_python_chain_runs_where_the_native_one_cannot(tiny_target, monkeypatch):
    monkeypatch.setattr(native_chain, "load", lambda: False)
    d = random_drafter(True, seed=1)
    tiny_target.set_taps(d.target_layer_ids)
    d.reset()
    d.add_context(tiny_target.prefill([1, 5, 6, 7]).features, 0)
    out = d.draft(9, 4, tiny_target)
    calls = []
    monkeypatch.setattr(native_chain, "domino_chain", lambda *a, **kw: calls.append(a) or domino_chain(*a, **kw))
    tree = native_chain.domino_chain_native(d, out, 9, tiny_target, d.num_depths)
    assert len(calls) == 1 and torch.equal(tree.tokens, domino_chain(d, out, 9, tiny_target, d.num_depths).tokens)


@pytest.mark.parametrize("draft_vocab", [None, 48])
def test_domino_generation_with_each_chain_is_plain_decoding(tiny_target, tmp_path, draft_vocab, native_only):
    from test_draft_vocab import shard_dir
    from conftest import VOCAB
    drafter = random_drafter(True, seed=4)
    prompt = [5, 9, 11, 3, 40]
    kw = {}
    if draft_vocab:
        source = shard_dir(tmp_path / "s", [list(range(1, VOCAB, 2)) * 3])
        kw = dict(draft_vocab=draft_vocab, corr_topm=16, draft_vocab_source=source)
    want = dt.generate(tiny_target, None, prompt, method="ar", max_new_tokens=24).token_ids
    runs = {b: dt.generate(tiny_target, drafter, prompt, method="domino", builder=b, max_new_tokens=24, **kw)
            for b in ("native", "fast", "reference")}
    for builder, got in runs.items():
        assert got.token_ids == want, builder
    assert runs["native"].stats["accepted_per_round"] == runs["reference"].stats["accepted_per_round"]
