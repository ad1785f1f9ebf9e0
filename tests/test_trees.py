"""Tree builders against brute force on tiny vocabularies; the fast builder against the reference."""
import itertools
import math
import time

import pytest
import torch
import torch.nn.functional as F

from conftest import drafter_config
from dominotree.drafters import DominoHead
from dominotree.trees.caddtree import CostModel, build_caddtree, monotone_convex_fit, profile
from dominotree.trees.ddtree import build_ddtree
from dominotree.trees.dominotree import build_dominotree
from dominotree.trees.fast import GruInputs, HeadWeights, build_dominotree_fast, gru_from_halves
from dominotree.trees.tree import DraftTree


def paths(tree: DraftTree):
    toks = tree.tokens.tolist()
    return {tuple(toks[j] for j in tree.path(i)[1:]) for i in range(1, len(tree))}


def check_structure(tree: DraftTree):
    parents, depths = tree.parents.tolist(), tree.depths.tolist()
    for i in range(1, len(tree)):
        assert parents[i] < i and depths[i] == depths[parents[i]] + 1
    kids = tree.children()
    for k in kids:   # siblings are distinct tokens
        assert len({int(tree.tokens[c]) for c in k}) == len(k)
    s = tree.scores[1:]
    assert torch.all(s[1:] <= s[:-1] + 1e-6), "nodes are not in best-first order"


@pytest.mark.parametrize("seed", range(12))
def test_ddtree_is_the_top_budget_prefixes(seed):
    g = torch.Generator().manual_seed(seed)
    V, D = 5, 3
    lp = torch.log_softmax(torch.randn(D, V, generator=g) * 2, -1)
    every = [seq for d in range(1, D + 1) for seq in itertools.product(range(V), repeat=d)]
    score = {s: sum(float(lp[i, t]) for i, t in enumerate(s)) for s in every}
    for budget in (1, 4, 9, 20, len(every)):
        tree = build_ddtree(lp, budget, root_token=99)
        best = sorted(every, key=lambda s: -score[s])[:budget]
        assert paths(tree) == set(best)
        check_structure(tree)
        for i in range(1, len(tree)):
            p = tuple(int(tree.tokens[j]) for j in tree.path(i)[1:])
            assert tree.scores[i].item() == pytest.approx(score[p], abs=1e-5)
        assert int(tree.tokens[0]) == 99


@pytest.mark.parametrize("seed", range(4))
def test_ddtree_on_a_real_sized_vocabulary(seed):
    """V = 8192 takes the blocked top-k; the top-budget prefixes only use each depth's top-budget
    tokens, so brute force over those is exact."""
    g = torch.Generator().manual_seed(seed)
    D, V, budget = 3, 8192, 6
    lp = torch.log_softmax(torch.randn(D, V, generator=g) * 3, -1)
    tops = [torch.topk(lp[d], budget).indices.tolist() for d in range(D)]
    every = [seq for d in range(1, D + 1) for seq in itertools.product(*tops[:d])]
    score = {s: sum(float(lp[i, t]) for i, t in enumerate(s)) for s in every}
    tree = build_ddtree(lp, budget)
    assert paths(tree) == set(sorted(every, key=lambda s: -score[s])[:budget])
    check_structure(tree)


@pytest.mark.parametrize("seed", range(6))
def test_ddtree_on_compact_rows_is_the_vocabulary_wide_tree(seed):
    """A draft vocabulary's compact rows with their token ids give the tree of the [D, V] rows
    that are -inf off the subset."""
    g = torch.Generator().manual_seed(seed)
    D, V, budget = 4, 300, 12
    ids = torch.randperm(V, generator=g)[:40].sort().values
    compact = torch.randn(D, len(ids), generator=g) * 3
    full = torch.full((D, V), float("-inf")).index_copy_(1, ids, compact)
    a = build_ddtree(torch.log_softmax(full, -1), budget, root_token=2)
    b = build_ddtree(torch.log_softmax(compact, -1), budget, root_token=2, token_ids=ids)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    assert torch.allclose(a.scores, b.scores, atol=1e-5)
    assert set(b.tokens[1:].tolist()) <= set(ids.tolist())


def test_ddtree_ties_are_deterministic():
    lp = torch.log_softmax(torch.zeros(3, 4), -1)     # everything ties
    a, b = build_ddtree(lp, 10), build_ddtree(lp, 10)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    check_structure(a)


# ----------------------------------------------------------------------------- DominoTree
def random_problem(seed, V=40, D=4, h=64, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    cfg = drafter_config(True)
    cfg.vocab_size = V
    head = DominoHead(cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.5, generator=g)
    base = torch.randn(D, V, generator=g) * scale
    hidden = torch.randn(D, h, generator=g)
    embed = torch.randn(V, h, generator=g)
    return head, base, hidden, embed


def brute_force_dominotree(head, base, hidden, embed, root, budget, k, M, normalization, prefix_len):
    """Enumerate the whole k-per-expansion tree with independently computed conditional scores."""
    D, V = base.shape
    W1, W2 = head.embed_proj[0].weight, head.embed_proj[2].weight

    def state_of(path_tokens):
        out, _ = head.prefix_gru(embed[torch.tensor([root] + list(path_tokens))][None])
        return out[0, -1]

    def children(path_tokens):
        d = len(path_tokens) + 1
        if d <= prefix_len:
            lp = F.log_softmax(base[d - 1], -1)
            top = torch.topk(lp, k)
            return list(zip(top.indices.tolist(), top.values.tolist()))
        s = state_of(path_tokens)
        full = base[d - 1] + W2 @ F.silu(W1 @ torch.cat([hidden[d - 1], s]))
        cand = torch.arange(V) if M is None else torch.topk(base[d - 1], M).indices
        if normalization == "exact" or M is None:
            lp = F.log_softmax(full, -1)[cand]
        else:
            lp = F.log_softmax(full[cand], -1)
        top = torch.topk(lp, k)
        return list(zip(cand[top.indices].tolist(), top.values.tolist()))

    nodes, frontier = {}, [((), 0.0)]
    for _ in range(D):
        nxt = []
        for path, sc in frontier:
            for tok, lp in children(path):
                nodes[path + (tok,)] = sc + lp
                nxt.append((path + (tok,), sc + lp))
        frontier = nxt
    best = sorted(nodes, key=lambda p: -nodes[p])[:budget]
    return set(best), nodes


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("normalization", ["topm", "exact"])
def test_dominotree_is_the_top_budget_conditional_nodes(seed, normalization):
    head, base, hidden, embed = random_problem(seed)
    with torch.no_grad():
        for budget, k, M, prefix in [(10, 3, 8, 1), (25, 3, 6, 0), (7, 2, None, 1), (40, 3, 12, 1)]:
            want, scores = brute_force_dominotree(head, base, hidden, embed, 7, budget, k, M, normalization, prefix)
            tree = build_dominotree(base, hidden, head, embed, 7, budget, node_topk=k, corr_topm=M,
                                    normalization=normalization, prefix_len=prefix)
            assert paths(tree) == want
            check_structure(tree)
            for i in range(1, len(tree)):
                p = tuple(int(tree.tokens[j]) for j in tree.path(i)[1:])
                assert tree.scores[i].item() == pytest.approx(scores[p], abs=1e-4)


def test_correction_changes_the_tree():
    """Path conditioning matters: with the head's correction zeroed the tree differs."""
    head, base, hidden, embed = random_problem(3, scale=0.5)
    with torch.no_grad():
        a = build_dominotree(base, hidden, head, embed, 7, 12, node_topk=3, corr_topm=10)
        head.embed_proj[2].weight.zero_()
        b = build_dominotree(base, hidden, head, embed, 7, 12, node_topk=3, corr_topm=10)
    assert paths(a) != paths(b)


@pytest.mark.parametrize("seed", range(300))
def test_fast_builder_equals_reference(seed):
    g = torch.Generator().manual_seed(10_000 + seed)
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=g))]
    V, D = pick([30, 64, 200, 4096]), pick([1, 3, 8, 16])   # 4096: the blocked top-k
    head, base, hidden, embed = random_problem(seed, V=V, D=D, scale=pick([0.5, 2.0, 5.0]))
    kw = dict(budget=pick([1, 4, 16, 32, 64]), node_topk=pick([1, 2, 4, 8]), corr_topm=pick([None, 8, 16, 64]),
              normalization=pick(["topm", "exact"]), prefix_len=pick([0, 1, 2]),
              max_depth=pick([None, 2, D]), conditioning=pick(["path", "path", "greedy"]))
    with torch.no_grad():
        ref = build_dominotree(base, hidden, head, embed, 5, **kw)
        fast = build_dominotree_fast(base, hidden, head, embed, 5, **kw, lookahead=pick([1, 4, 32]))
    assert torch.equal(ref.tokens, fast.tokens), kw
    assert torch.equal(ref.parents, fast.parents), kw
    assert torch.allclose(ref.scores, fast.scores, atol=1e-5), kw


@pytest.mark.parametrize("seed", range(40))
def test_dominotree_on_compact_rows_is_the_vocabulary_wide_tree(seed):
    """Both builders given a draft vocabulary's compact rows and token ids build the tree of the
    [D, V] rows that are -inf off the subset: in the published setting from the compact rows
    alone, in the settings that score the whole vocabulary (no top-M, exact normalisation,
    greedy conditioning, M = N) from rows they widen."""
    g = torch.Generator().manual_seed(20_000 + seed)
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=g))]
    V, D, N = pick([64, 200, 4096]), pick([1, 3, 8]), pick([16, 24, 40])
    head, _, hidden, embed = random_problem(seed, V=V, D=D)
    ids = torch.randperm(V, generator=g)[:N].sort().values
    compact = torch.randn(D, N, generator=g) * pick([0.5, 2.0, 5.0])
    full = torch.full((D, V), float("-inf")).index_copy_(1, ids, compact)
    kw = dict(budget=pick([1, 4, 16, 32]), node_topk=pick([1, 2, 4, 8]), corr_topm=pick([None, 8, 16, N]),
              normalization=pick(["topm", "topm", "exact"]), prefix_len=pick([0, 1, 2]),
              conditioning=pick(["path", "path", "greedy"]))
    with torch.no_grad():
        wide = build_dominotree(full, hidden, head, embed, 5, **kw)
        ref = build_dominotree(compact, hidden, head, embed, 5, vocab_ids=ids, **kw)
        fast = build_dominotree_fast(compact, hidden, head, embed, 5, vocab_ids=ids, **kw)
    for tree in (ref, fast):
        assert torch.equal(wide.tokens, tree.tokens) and torch.equal(wide.parents, tree.parents), kw
        assert torch.allclose(wide.scores, tree.scores, atol=1e-5), kw
    assert set(ref.tokens[1:].tolist()) <= set(ids.tolist())


def test_gru_input_table_rows_are_the_product_whatever_the_order_and_follow_the_weights():
    g = torch.Generator().manual_seed(0)
    embed, w_ih = torch.randn(100, 16, generator=g), torch.randn(24, 16, generator=g)
    want = F.linear(embed, w_ih)
    a, b = GruInputs(embed, w_ih, block=32), GruInputs(embed, w_ih, block=32)
    first = a.rows([99, 5, 64, 5])                        # 99: the last, shorter block
    assert torch.allclose(first, want[[99, 5, 64, 5]], atol=1e-5)
    assert a.ready_blocks() == {0, 2, 3}                            # only the blocks asked for
    for t in range(100):                                   # same values whichever tokens came first
        b.rows([t])
    assert torch.equal(a.rows([5, 64, 99, 31]), b.rows([5, 64, 99, 31]))
    head = random_problem(0)[0]
    W = HeadWeights(head)
    e = torch.randn(40, 64, generator=g)
    G = W.w_hh.shape[1]
    s = torch.randn(2, G, generator=g)
    plain = W.gru(s, e[[3, 7]])                            # the GRU step with both products made afresh
    halves = gru_from_halves(W.input_rows(e, [3, 7]), F.linear(s, W.s_proj)[:, -3 * G:], s)
    assert torch.allclose(halves, plain, atol=1e-5)
    table = W.inputs
    assert W.input_rows(e, [3]) is not None and W.inputs is table           # kept across calls
    with torch.no_grad():
        e.mul_(2)                                                              # weights changed in place
    assert torch.allclose(W.input_rows(e, [3, 7]), F.linear(e[[3, 7]], W.w_ih), atol=1e-5) and W.inputs is not table


def test_warming_the_gru_table_fills_the_blocks_of_the_tokens_once():
    g = torch.Generator().manual_seed(1)
    W, e = HeadWeights(random_problem(0)[0]), torch.randn(100, 64, generator=g)
    ids = torch.tensor([3, 40, 41, 99])
    W.warm(e, ids)
    assert W.inputs.ready_blocks() == {0, 1, 3}
    assert torch.equal(W.input_rows(e, [41, 3, 99]), GruInputs(e, W.w_ih).rows([41, 3, 99]))
    calls = []
    W.inputs.fill = lambda tokens: calls.append(tokens)
    W.warm(e, ids)
    assert calls == []                                     # the same token set: nothing to do


def test_fast_builder_keeps_root_rows_across_rounds_and_drops_them_with_the_embedding():
    """One HeadWeights across rounds (as a drafter keeps it): the root rows it caches give the
    reference's trees for every root, repeated roots included, and a changed embedding is not
    served the old rows."""
    head, base, hidden, embed = random_problem(4, V=64, D=6)
    W = HeadWeights(head)
    kw = dict(budget=12, node_topk=3, corr_topm=16)
    with torch.no_grad():
        for root in [5, 9, 5, 63, 9, 0]:
            ref = build_dominotree(base, hidden, head, embed, root, **kw)
            fast = build_dominotree_fast(base, hidden, head, embed, root, weights=W, **kw)
            assert torch.equal(ref.tokens, fast.tokens) and torch.equal(ref.parents, fast.parents), root
        assert set(W.inputs.roots) == {0, 5, 9, 63}
        old = W.inputs.roots[5]
        embed.mul_(-1.5)                                   # in place: the table and the roots are stale
        ref = build_dominotree(base, hidden, head, embed, 5, **kw)
        fast = build_dominotree_fast(base, hidden, head, embed, 5, weights=W, **kw)
    assert torch.equal(ref.tokens, fast.tokens) and torch.equal(ref.parents, fast.parents)
    assert torch.allclose(ref.scores, fast.scores, atol=1e-5)
    assert not torch.equal(W.inputs.roots[5], old)


def test_domino_drafter_keeps_one_tree_weights_until_its_head_changes():
    from conftest import random_drafter
    d = random_drafter(True)
    w = d.tree_weights()
    assert d.tree_weights() is w
    with torch.no_grad():
        d.head.embed_proj[0].weight.add_(1.0)
    w2 = d.tree_weights()
    assert w2 is not w and torch.equal(w2.w1_h, d.head.embed_proj[0].weight.float()[:, :d.config.hidden_size])


# ----------------------------------------------------------------------------- CaDDTree
def test_caddtree_stops_where_theta_first_fails_to_increase():
    g = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(torch.randn(6, 20, generator=g) * 3, -1)
    curve = [10.0, 10.0, 10.2, 10.4, 10.6, 11.0, 14.0, 20.0, 30.0] + [30.0 + 8 * i for i in range(1, 60)]
    cost = CostModel(c_draft=5.0, curves={100: curve})
    full = build_ddtree(lp, 64)
    theta = lambda n: (1 + sum(math.exp(s) for s in full.scores[1:n + 1].tolist())) / (5.0 + cost.c_verify(n, 100))
    expected = next(n for n in range(64) if theta(n + 1) <= theta(n))
    tree = build_caddtree(lp, cost, 100, max_budget=64)
    assert len(tree) - 1 == expected
    assert 0 < expected < 64
    assert torch.equal(tree.tokens, full.tokens[:expected + 1])


def test_cost_model_fit_is_monotone_convex_and_round_trips(tmp_path):
    g = torch.Generator().manual_seed(0)
    n = torch.arange(1, 41).float()
    truth = 50 + 0.02 * n ** 2
    noisy = {n_: [float(truth[n_ - 1] + torch.randn(1, generator=g) * 2) for _ in range(3)] for n_ in range(1, 41)}
    cm = CostModel.fit(7.0, {128: noisy, 512: {k: [v[0] * 1.5] for k, v in noisy.items()}})
    c = torch.tensor(cm.curves[128][1:], dtype=torch.float64)   # index 0 is Cv(0), clamped to Cv(1)
    assert torch.all(c[1:] >= c[:-1] - 1e-9)
    assert torch.all(c[2:] - 2 * c[1:-1] + c[:-2] >= -1e-6)
    assert abs(cm.c_verify(20, 128) - float(truth[19])) < 3
    assert cm.c_verify(20, 128) < cm.c_verify(20, 300) < cm.c_verify(20, 512)
    cm.save(tmp_path / "cm.json")
    assert CostModel.load(tmp_path / "cm.json").c_verify(33, 200) == pytest.approx(cm.c_verify(33, 200))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="cost model"):
        CostModel.load(tmp_path / "bad.json")


def test_monotone_convex_fit_projects_a_concave_curve():
    y = [0, 5, 8, 9, 9.5]
    f = monotone_convex_fit(y)
    d1, d2 = f[1:] - f[:-1], f[2:] - 2 * f[1:-1] + f[:-2]
    assert (d1 >= -1e-9).all() and (d2 >= -1e-9).all()


def test_tree_helpers():
    t = DraftTree.from_lists([9, 1, 2, 3, 4], [-1, 0, 0, 1, 3])
    assert t.path(4) == [0, 1, 3, 4]
    anc = t.ancestor_mask()
    assert anc[4].tolist() == [True, True, False, True, True]
    pos, _ = t.flatten(10)
    assert pos.tolist() == [10, 11, 11, 12, 13]
    cut = t.truncate_depth(1)
    assert cut.tokens.tolist() == [9, 1, 2] and cut.parents.tolist() == [-1, 0, 0]
    with pytest.raises(ValueError):
        DraftTree.from_lists([1, 2], [-1, 1])


def test_profile_measures_every_tree_size_and_leaves_the_target_clean(tiny_target):
    import dominotree as dt
    from conftest import random_drafter
    drafter = random_drafter(False, seed=1)
    before = dt.generate(tiny_target, drafter, [5, 6, 7], method="ddtree", max_new_tokens=12).token_ids
    cm = profile(tiny_target, drafter, max_nodes=6, contexts=(8, 24), repeats=2, progress=False)
    assert sorted(cm.curves) == [8, 24] and all(len(c) == 7 for c in cm.curves.values())
    assert all(b >= a for c in cm.curves.values() for a, b in zip(c, c[1:]))     # non-decreasing fit
    assert cm.c_draft > 0 and tiny_target.length == 0
    # the target and the drafter decode exactly as before the profile
    assert dt.generate(tiny_target, drafter, [5, 6, 7], method="ddtree", max_new_tokens=12).token_ids == before
    assert before == dt.generate(tiny_target, None, [5, 6, 7], method="ar", max_new_tokens=12).token_ids


@pytest.mark.parametrize("bad, match", [
    ({"max_nodes": 0}, "max_nodes must be an integer >= 1"), ({"repeats": 0}, "repeats must be"),
    ({"contexts": ()}, "contexts must be distinct"), ({"contexts": (-5,)}, "contexts must be distinct"),
    ({"contexts": (8, 8)}, "contexts must be distinct"), ({"contexts": (250,)}, "exceed the target's context of 256"),
])
def test_a_bad_profile_request_is_refused_before_any_timing(tiny_target, bad, match):
    length = tiny_target.length
    with pytest.raises(ValueError, match=match):
        profile(tiny_target, None, **{"max_nodes": 6, "contexts": (8,), "repeats": 1, "progress": False, **bad})
    assert tiny_target.length == length        # nothing ran on the target


def test_profile_warms_every_tree_size_before_timing_it(tiny_target, monkeypatch):
    """A shape's first verify is slow on CPU (kernel creation); that one-off cost must not enter the curve."""
    from conftest import random_drafter
    seen, verify = set(), tiny_target.verify

    def cold_first_call(tree, **kw):
        if len(tree) not in seen:       # 60 ms more on the first call of each tree size only
            seen.add(len(tree))
            time.sleep(0.06)
        return verify(tree, **kw)
    monkeypatch.setattr(tiny_target, "verify", cold_first_call)
    cm = profile(tiny_target, random_drafter(False, seed=1), max_nodes=8, contexts=(8,), repeats=2,
                          progress=False)
    assert max(cm.curves[8]) < 10, cm.curves[8]   # ~2 ms warm; ~25 ms when the cold calls are timed


def test_profile_draft_cost_survives_a_burst_of_slow_calls(tiny_target, monkeypatch):
    """A few slow drafts (load from elsewhere) must not set C_draft: its samples span the whole profile."""
    from conftest import random_drafter
    drafter = random_drafter(False, seed=1)
    calls, draft = [0], drafter.draft

    def burst(*a, **kw):
        calls[0] += 1
        if calls[0] <= 4:                   # the warm-up and the next three calls are 60 ms slower
            time.sleep(0.06)
        return draft(*a, **kw)
    monkeypatch.setattr(drafter, "draft", burst)
    cm = profile(tiny_target, drafter, max_nodes=8, contexts=(8,), repeats=2, progress=False)
    assert calls[0] > 8 and cm.c_draft < 10, (calls[0], cm.c_draft)
