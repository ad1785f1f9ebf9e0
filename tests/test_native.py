"""The compiled DominoTree builder: bit-identical to the Python fast builder, the reference's trees,
and a clean fallback wherever it does not run."""
import shutil
import warnings

import pytest
import torch

from test_trees import random_problem
from dominotree.trees import native
from dominotree.trees.caddtree import CostModel
from dominotree.trees.dominotree import build_dominotree, path_probability_stop
from dominotree.trees.fast import HeadWeights, build_dominotree_fast

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler: the native builder cannot be built here")

FIELDS = ("tokens", "parents", "depths", "scores")


def same_tree(a, b):
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in FIELDS)


def refuse_fallback(monkeypatch, module, fallback: str, what: str):
    """Load the native library and make `module.fallback` (the Python path) fail the test if called."""
    assert native.load(), native.status()

    def refuse(*args, **kwargs):
        raise AssertionError(f"the native {what} fell back to the Python one")

    monkeypatch.setattr(module, fallback, refuse)


@pytest.fixture
def native_only(monkeypatch):
    """Fail a test whose build falls back to the Python builder."""
    refuse_fallback(monkeypatch, native, "build_dominotree_fast", "builder")


def random_case(seed):
    g = torch.Generator().manual_seed(30_000 + seed)
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=g))]
    V, D = pick([30, 64, 200, 4096]), pick([1, 3, 8, 16])
    head, base, hidden, embed = random_problem(seed, V=V, D=D, scale=pick([0.5, 2.0, 5.0]))
    node_topk = pick([1, 2, 4, 8])
    kw = dict(budget=pick([1, 2, 4, 16, 32, 64]), node_topk=node_topk,
              corr_topm=pick([m for m in (8, 16, 24) if node_topk <= m < V]),
              prefix_len=pick([0, 1, 2]), max_depth=pick([None, 2, D]), lookahead=pick([1, 4, 32]))
    ids = None
    if pick([False, True]) and V >= 64:                # compact rows over a draft vocabulary
        ids = torch.randperm(V, generator=g)[:pick([32, 48])].sort().values
        base = base[:, ids]
    return head, base, hidden, embed, int(torch.randint(V, (1,), generator=g)), ids, kw


@pytest.mark.parametrize("seed", range(200))
def test_native_builder_is_bit_identical_to_the_fast_builder(seed, native_only):
    head, base, hidden, embed, root, ids, kw = random_case(seed)
    with torch.no_grad():
        fast = build_dominotree_fast(base, hidden, head, embed, root, vocab_ids=ids, **kw)
        nat = native.build_dominotree_native(base, hidden, head, embed, root, vocab_ids=ids, **kw)
        plain = {k: v for k, v in kw.items() if k != "lookahead"}
        ref = build_dominotree(base, hidden, head, embed, root, vocab_ids=ids, **plain)
        own = native.build_dominotree_native(base, hidden, head, embed, root, vocab_ids=ids, **plain)
    assert same_tree(fast, nat), kw                    # the same lookahead: the same batches, the same bits
    for tree in (nat, own):                            # any lookahead (its own default too): the reference's tree
        assert torch.equal(ref.tokens, tree.tokens) and torch.equal(ref.parents, tree.parents), kw
        assert torch.allclose(ref.scores, tree.scores, atol=1e-5), kw


@pytest.mark.parametrize("seed", range(30))
def test_native_builder_applies_the_throughput_stop_as_the_python_builders(seed, native_only):
    head, base, hidden, embed, root, ids, kw = random_case(seed)
    g = torch.Generator().manual_seed(seed)
    slope = float(torch.rand(1, generator=g)) * 2
    cost = CostModel(c_draft=4.0, curves={64: [30 + slope * n for n in range(65)],
                                          512: [33 + 1.5 * slope * n for n in range(65)]})
    kw["budget"] = 64
    with torch.no_grad():
        fast = build_dominotree_fast(base, hidden, head, embed, root, vocab_ids=ids,
                                     stop=path_probability_stop(cost, 200), **kw)
        nat = native.build_dominotree_native(base, hidden, head, embed, root, vocab_ids=ids,
                                             stop=path_probability_stop(cost, 200), **kw)
    assert same_tree(fast, nat), kw
    assert len(nat) - 1 < 64 or slope < 0.05           # the rule stopped it (not the budget)


def test_native_builder_shares_the_gru_input_table_with_the_python_builder(native_only):
    head, base, hidden, embed = random_problem(3, V=4096, D=4)
    W = HeadWeights(head)
    with torch.no_grad():
        native.build_dominotree_native(base, hidden, head, embed, 150, budget=6, node_topk=2, corr_topm=8, weights=W)
    filled = W.inputs.ready_blocks()
    assert 150 // W.inputs.block in filled and len(filled) < len(W.inputs.ready)   # only the blocks it used
    rows = sorted(b * W.inputs.block for b in filled)
    fresh = HeadWeights(head)
    assert torch.equal(W.input_rows(embed, rows), fresh.input_rows(embed, rows))   # the values Python computes


@pytest.mark.parametrize("setting", [dict(conditioning="greedy"), dict(normalization="exact"),
                                     dict(corr_topm=None), dict(corr_topm=4, node_topk=8), dict(embedding_module=True)])
def test_settings_the_native_builder_does_not_cover_run_the_fast_builder(setting):
    head, base, hidden, embed = random_problem(5, V=64, D=6)
    kw = dict(budget=12, node_topk=3, corr_topm=16)
    kw.update(setting)
    if kw.pop("embedding_module", False):
        module = torch.nn.Embedding.from_pretrained(embed)
        embed = module
    with torch.no_grad():
        fast = build_dominotree_fast(base, hidden, head, embed, 5, **kw)
        nat = native.build_dominotree_native(base, hidden, head, embed, 5, **kw)
    assert not native.covers(kw.get("normalization", "topm"), kw.get("conditioning", "path"), kw["corr_topm"],
                             kw["node_topk"], 64, embed, None)
    assert same_tree(fast, nat)


def test_a_builder_that_cannot_be_compiled_warns_once_and_falls_back(monkeypatch):
    from torch.utils import cpp_extension
    monkeypatch.setattr(native, "_state", {"loaded": None, "error": None})

    def broken(*args, **kwargs):
        raise RuntimeError("Error building extension 'dominotree_native'\nno compiler")

    monkeypatch.setattr(cpp_extension, "load", broken)
    head, base, hidden, embed = random_problem(6, V=64, D=6)
    kw = dict(budget=12, node_topk=3, corr_topm=16)
    with pytest.warns(RuntimeWarning, match="native tree builder is unavailable"):
        nat = native.build_dominotree_native(base, hidden, head, embed, 5, **kw)
    assert native.status().startswith("fast (RuntimeError")
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # no second warning
        again = native.build_dominotree_native(base, hidden, head, embed, 5, **kw)
    assert same_tree(nat, build_dominotree_fast(base, hidden, head, embed, 5, **kw)) and same_tree(nat, again)


def test_the_native_builder_can_be_switched_off(monkeypatch):
    monkeypatch.setattr(native, "_state", {"loaded": None, "error": None})
    monkeypatch.setenv("DOMINOTREE_NATIVE", "0")
    assert native.status() == "fast (disabled by DOMINOTREE_NATIVE=0)"


def test_generation_with_each_builder_is_plain_decoding(tiny_target, native_only):
    import dominotree as dt
    from conftest import random_drafter
    drafter = random_drafter(True, seed=2)
    prompt = [5, 9, 11, 3, 40]
    want = dt.generate(tiny_target, None, prompt, method="ar", max_new_tokens=24).token_ids
    for builder in ("native", "fast", "reference"):
        got = dt.generate(tiny_target, drafter, prompt, method="dominotree", budget=6, node_topk=3, corr_topm=8,
                          builder=builder, max_new_tokens=24)
        assert got.token_ids == want, builder
