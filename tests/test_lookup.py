"""Prompt-lookup branch: the n-gram index against a plain scan, the merge against brute force,
and generation with the branch lossless at T = 0 (and faster where the context repeats)."""
import random

import pytest
import torch

import dominotree as dt
from conftest import random_drafter
from dominotree.trees.ddtree import build_ddtree
from dominotree.trees.lookup import NgramIndex, lookup_reference, merge_branch
from dominotree.trees.tree import DraftTree
from helpers import reference_sequence


def paths(tree: DraftTree) -> set:
    toks = tree.tokens.tolist()
    return {tuple(toks[j] for j in tree.path(i)[1:]) for i in range(1, len(tree))}


def check_valid(tree: DraftTree):
    parents, depths = tree.parents.tolist(), tree.depths.tolist()
    assert parents[0] == -1 and depths[0] == 0
    for i in range(1, len(tree)):
        assert 0 <= parents[i] < i and depths[i] == depths[parents[i]] + 1
    for kids in tree.children():
        assert len({int(tree.tokens[c]) for c in kids}) == len(kids), "siblings must be distinct tokens"


def test_lookup_takes_the_longest_suffix_and_its_latest_occurrence():
    idx = NgramIndex(max_n=3)
    idx.extend([5, 6, 7, 9, 5, 6, 8, 4, 5, 6])
    # (4, 5, 6) never occurred before; (5, 6) did twice: the latest one (followed by 8) wins
    assert idx.lookup(3) == [8, 4, 5]
    idx.extend([7])
    assert idx.lookup(2) == [9, 5]          # (5, 6, 7) matches at the start
    assert NgramIndex().lookup(4) == []
    idx2 = NgramIndex(max_n=2, min_n=2)
    idx2.extend([1, 2, 3, 4, 9, 3])
    assert idx2.lookup(4) == []             # only a 1-token match exists, below min_n


@pytest.mark.parametrize("seed", range(20))
def test_index_equals_a_plain_scan(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5, 8])
    max_n, min_n = rng.choice([(1, 1), (2, 1), (3, 1), (3, 2), (4, 2)])
    idx, seq = NgramIndex(max_n, min_n), []
    for _ in range(30):
        chunk = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        idx.extend(chunk)
        seq += chunk
        for k in (1, 4, 9):
            assert idx.lookup(k) == lookup_reference(seq, k, max_n, min_n), (seq, k)


def expected_paths(tree: DraftTree, branch: list[int], max_new=None) -> set:
    """Brute force: the branch's prefixes, then the best-scored other paths up to the tree's size."""
    toks, scores = tree.tokens.tolist(), tree.scores.tolist()
    score = {tuple(toks[j] for j in tree.path(i)[1:]): scores[i] for i in range(1, len(tree))}
    prefixes = [tuple(branch[:d]) for d in range(1, len(branch) + 1)]
    shared = [p for p in prefixes if p in score]
    others = sorted((p for p in score if p not in prefixes), key=lambda p: -score[p])
    novel = [p for p in prefixes if p not in score][:len(others) if max_new is None else min(max_new, len(others))]
    return set(shared) | set(novel) | set(others[:len(others) - len(novel)])


@pytest.mark.parametrize("seed", range(30))
def test_merge_keeps_the_size_and_drops_the_lowest_scored_paths(seed):
    g, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    V, D = 4, 4
    lp = torch.log_softmax(torch.randn(D, V, generator=g) * 2, -1)
    tree = build_ddtree(lp, rng.choice([1, 3, 6, 12]), root_token=9)
    branch = [rng.randrange(V) for _ in range(rng.randint(0, 6))]
    max_new = rng.choice([None, 0, 1, 2, 5])
    merged, n_new = merge_branch(tree, branch, max_new)
    check_valid(merged)
    assert len(merged) == len(tree) and int(merged.tokens[0]) == 9
    assert paths(merged) == expected_paths(tree, branch, max_new)
    new_paths = paths(merged) - paths(tree)
    assert n_new == len(new_paths)
    # the new nodes are the last ones
    assert {tuple(merged.tokens[j].item() for j in merged.path(i)[1:])
            for i in range(len(merged) - n_new, len(merged))} == new_paths


def test_merge_of_a_branch_already_in_the_tree_is_the_same_tree():
    tree = DraftTree.from_lists([9, 1, 2, 3], [-1, 0, 1, 0], [0, -0.1, -0.3, -0.5])
    assert merge_branch(tree, [1, 2])[0] is tree
    assert merge_branch(tree, [])[0] is tree
    merged, n_new = merge_branch(tree, [1, 2, 7, 8])     # only node 3 is off the branch: one new node
    assert n_new == 1 and paths(merged) == {(1,), (1, 2), (1, 2, 7)}
    merged, n_new = merge_branch(tree, [3, 5])           # 1 -> 2 goes first (the lower score), not 3
    assert n_new == 1 and paths(merged) == {(1,), (3,), (3, 5)}
    chain = DraftTree.chain(9, [4, 5, 6])
    merged, n_new = merge_branch(chain, [7, 7, 7, 7, 7])  # cut to the 3 nodes the chain can give up
    assert n_new == 3 and paths(merged) == {(7,), (7, 7), (7, 7, 7)}


def test_merge_takes_at_most_max_new_nodes():
    chain = DraftTree.chain(9, [4, 5, 6, 7, 8, 3], scores=[-0.1, -0.2, -0.3, -0.4, -0.5, -0.6])
    merged, n_new = merge_branch(chain, [1, 2, 3, 4, 5], max_new=3)
    assert n_new == 3 and len(merged) == len(chain)
    assert paths(merged) == {(1,), (1, 2), (1, 2, 3), (4,), (4, 5), (4, 5, 6)}
    assert merge_branch(chain, [1, 2], max_new=0)[0] is chain


def test_bad_lookup_options_are_rejected():
    with pytest.raises(ValueError, match="lookup must be"):
        dt.SpecConfig(method="dominotree", lookup=-1)
    with pytest.raises(ValueError, match="method 'ar'"):
        dt.SpecConfig(method="ar", lookup=4)
    with pytest.raises(ValueError, match="lookup_ngram"):
        dt.SpecConfig(method="ddtree", lookup=4, lookup_ngram=0)


def repeating_prompt(target, base):
    """The base prompt, the target's own greedy continuation of it, then the base again: a context
    whose continuation the lookup can often copy."""
    ref, _ = reference_sequence(target, base, 16)
    return ref + base[1:]


@pytest.mark.parametrize("method", ["dflash", "domino", "ddtree", "dominotree"])
def test_lookup_branch_is_lossless_and_gets_accepted(tiny_target, method):
    hits = 0
    for i, base in enumerate([[1, 11, 12, 13], [1, 40, 41], [1, 70, 71, 72, 73, 74], [1, 25, 26]]):
        prompt = repeating_prompt(tiny_target, base)
        _, plain = reference_sequence(tiny_target, prompt, 40)
        drafter = random_drafter(method in ("domino", "dominotree"), seed=i)
        without = dt.generate(tiny_target, drafter, prompt, method=method, max_new_tokens=40, budget=6)
        out = dt.generate(tiny_target, drafter, prompt, method=method, max_new_tokens=40, budget=6, lookup=6)
        assert without.token_ids == plain.token_ids and out.token_ids == plain.token_ids, (method, i)
        assert "lookup_accepted" in out.stats and "lookup_accepted" not in without.stats
        # a random drafter's tokens are rarely accepted, so what the branch adds shows in tau
        if out.stats["lookup_accepted"] > 0:
            hits += 1
            assert out.stats["tau"] > without.stats["tau"]
    assert hits >= 2, "the lookup branch was never accepted: the test does not exercise it"
