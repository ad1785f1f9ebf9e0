"""Acceptance rules. Sample-and-match keeps the target's exact distribution (with a negative control)."""
import math
from collections import Counter

import pytest
import torch

import dominotree as dt
import dominotree.engine as engine
from conftest import random_drafter
from dominotree import DraftTree
from dominotree.verify import accept, draw, draw_rows, greedy_token, process_logits
from helpers import MirrorDrafter, ScriptedDrafter, reference_sequence, run_mirror

PROMPT = [1, 11, 12, 13]


def test_process_logits_matches_transformers_warpers():
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    for t, k, p in [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.9, 10, 0.5)]:
        x = TemperatureLogitsWarper(t)(None, logits.clone())
        if k:
            x = TopKLogitsWarper(k)(None, x)
        if p < 1:
            x = TopPLogitsWarper(p)(None, x)
        assert torch.allclose(process_logits(logits, t, k, p), x.softmax(-1), atol=1e-6)


def test_draw_follows_the_probabilities():
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])    # zeros at the ends and between
    n = 20_000
    chi2 = lambda counts: sum((counts[i] - n * float(probs[i])) ** 2 / (n * float(probs[i])) for i in (1, 3, 4))
    counts = Counter(draw(probs, g) for _ in range(n))
    assert set(counts) == {1, 3, 4}                         # zero-probability entries never drawn
    assert chi2(counts) < 13.8                              # chi-square, 2 dof, p = 0.001
    skewed = Counter(draw(torch.tensor([0.0, 0.45, 0.0, 0.25, 0.3, 0.0]), g) for _ in range(n))
    assert chi2(skewed) > 13.8                              # the statistic sees a 5-point shift
    assert draw(torch.tensor([0.0, 0.0, 1.0]), g) == 2
    ga, gb = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert [draw(probs, ga) for _ in range(20)] == [draw(probs, gb) for _ in range(20)]   # seeded


def test_draw_rows_draws_each_row_from_its_own_distribution():
    g = torch.Generator().manual_seed(1)
    probs = torch.tensor([[0.7, 0.3, 0.0], [0.0, 0.1, 0.9]])
    n = 10_000
    draws = torch.stack([draw_rows(probs, g) for _ in range(n)])      # [n, 2]
    assert draws[:, 0].max() <= 1 and draws[:, 1].min() >= 1
    assert abs(float((draws[:, 0] == 0).float().mean()) - 0.7) < 0.02
    assert abs(float((draws[:, 1] == 2).float().mean()) - 0.9) < 0.015


def test_greedy_token_is_torch_argmax_first_index_on_ties():
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for _ in range(50):
            # few distinct values: exact ties for the maximum in almost every row
            row = (torch.randint(0, 6, (4099,)).float() / 4 - 2).to(dtype)
            assert greedy_token(row) == int(torch.argmax(row.float()))
        row = torch.zeros(7, dtype=dtype)
        row[[2, 5]] = 1.0
        assert greedy_token(row) == 2                     # the first of two maxima, never the last
        assert greedy_token(row.flip(0)) == 1
    assert greedy_token(torch.tensor([1.0, 3.0, 2.0], requires_grad=True)) == 1
    assert greedy_token(torch.tensor([[0.0, 1.0], [1.0, 0.0]])) == int(torch.argmax(torch.tensor([[0.0, 1.0], [1.0, 0.0]])))


def test_greedy_walk_follows_target_argmax():
    tree = DraftTree.from_lists([9, 4, 5, 6, 7], [-1, 0, 0, 2, 3])
    logits = torch.zeros(5, 10)
    logits[0, 5] = logits[2, 6] = logits[3, 1] = 1     # root->5 (node 2), 5->6 (node 3), then 1: not a child
    path, bonus = accept(tree, logits)
    assert path == [0, 2, 3] and bonus == 1


def exact_joint(target, prompt, steps, temperature, top_k, top_p):
    """Exact distribution of the first `steps` emitted tokens under the processed target."""
    dist = {(): 1.0}
    for _ in range(steps):
        nxt = {}
        for prefix, p in dist.items():
            with torch.inference_mode():
                logits = target.model(input_ids=torch.tensor([prompt + list(prefix)])).logits[0, -1].float()
            probs = process_logits(logits, temperature, top_k, top_p)
            for tok in (probs > 0).nonzero().flatten().tolist():
                nxt[prefix + (tok,)] = p * float(probs[tok])
        dist = nxt
    return dist


def tv_and_bound(samples: Counter, exact: dict, n: int):
    keys = set(samples) | set(exact)
    tv = 0.5 * sum(abs(samples.get(k, 0) / n - exact.get(k, 0.0)) for k in keys)
    expected = 0.5 * sum(math.sqrt(2 * p * (1 - p) / (math.pi * n)) for p in exact.values())
    return tv, 1.5 * expected + 0.01


def always_accept(tree, logits, temperature=0.0, top_k=0, top_p=1.0, generator=None):
    """A broken verifier: follows the first child to a leaf, then samples the bonus."""
    kids, node, path = tree.children(), 0, [0]
    while kids[node]:
        node = kids[node][0]
        path.append(node)
    return path, dt.verify.pick_token(logits[node], temperature, top_k, top_p, generator)


CASES = [("dflash", 0.7, 4, 1.0, False), ("dominotree", 1.0, 0, 0.7, False), ("ddtree", 1.0, 5, 0.9, False),
         ("dominotree", 1.0, 0, 0.7, True)]


def sample_first_tokens(target, method, temperature, top_k, top_p, n, steps=3, scripted=False,
                        prompt=PROMPT, stats=None, **kw):
    """Mirror drafter: siblings are the target's real alternatives, so branches get accepted.
    Scripted drafter: half of its proposals are wrong, so a biased verifier shows."""
    drafter = MirrorDrafter(random_drafter(method in ("domino", "dominotree")), target, depth=steps)
    if scripted:
        ref, _ = reference_sequence(target, prompt, 12)
        drafter = ScriptedDrafter(drafter.inner, ref, wrong_rate=0.5)
    counts = Counter()
    for i in range(n):
        if scripted:
            drafter.seed = i   # which proposals are wrong varies from run to run, not only by position
        run = dt.generate if scripted else run_mirror
        r = run(target, drafter, prompt, method=method, max_new_tokens=steps, temperature=temperature,
                       top_k=top_k, top_p=top_p, seed=i, budget=6, node_topk=3, **kw)
        counts[tuple(r.token_ids[:steps])] += 1
        if stats is not None:
            stats.append(r.stats)
    return counts


@pytest.mark.parametrize("method, temperature, top_k, top_p, scripted", CASES)
def test_sample_and_match_keeps_the_target_distribution(tiny_target, method, temperature, top_k, top_p, scripted):
    n = 1000
    exact = exact_joint(tiny_target, PROMPT, 3, temperature, top_k, top_p)
    counts = sample_first_tokens(tiny_target, method, temperature, top_k, top_p, n, scripted=scripted)
    tv, bound = tv_and_bound(counts, exact, n)
    assert tv < bound, f"TV {tv:.3f} >= bound {bound:.3f}"


def test_sample_and_match_with_a_lookup_branch_keeps_the_distribution(tiny_target):
    """Scripted drafter, half wrong, and a prompt that repeats itself, so the branch gets accepted."""
    n, base = 1000, [1, 40, 41]
    ref, _ = reference_sequence(tiny_target, base, 8)
    prompt = ref + base[1:]
    exact = exact_joint(tiny_target, prompt, 3, 1.0, 0, 1.0)
    stats = []
    counts = sample_first_tokens(tiny_target, "ddtree", 1.0, 0, 1.0, n, scripted=True, prompt=prompt,
                                 stats=stats, lookup=3)
    assert sum(s["lookup_accepted"] > 0 for s in stats) > n // 10, "the branch was rarely accepted"
    tv, bound = tv_and_bound(counts, exact, n)
    assert tv < bound, f"TV {tv:.3f} >= bound {bound:.3f}"


def test_negative_control_always_accept_fails(tiny_target, monkeypatch):
    monkeypatch.setattr(engine, "accept", always_accept)
    n = 1000
    method, temperature, top_k, top_p, _ = CASES[3]   # the same drafter and settings pass with the real verifier
    exact = exact_joint(tiny_target, PROMPT, 3, temperature, top_k, top_p)
    counts = sample_first_tokens(tiny_target, method, temperature, top_k, top_p, n, scripted=True)
    tv, bound = tv_and_bound(counts, exact, n)
    assert tv > bound, "the distribution test cannot tell a biased verifier apart"


def test_trees_reach_non_first_children_at_t1(tiny_target):
    """The sampling test exercises branching: accepted nodes are sometimes not first children."""
    ref, _ = reference_sequence(tiny_target, PROMPT, 12)
    seen = Counter()
    orig = engine.accept

    def spy(tree, logits, *a, **k):
        path, bonus = orig(tree, logits, *a, **k)
        kids = tree.children()
        for parent, child in zip(path, path[1:]):
            seen[kids[parent].index(child)] += 1
        return path, bonus

    engine.accept = spy
    try:
        drafter = MirrorDrafter(random_drafter(False), tiny_target)
        for i in range(100):
            run_mirror(tiny_target, drafter, PROMPT, method="ddtree", max_new_tokens=6, temperature=1.0,
                       seed=i, budget=8)
    finally:
        engine.accept = orig
    assert seen[0] > 0 and sum(v for k, v in seen.items() if k > 0) > 0
