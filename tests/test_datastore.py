"""Datastore branch: the suffix array against a plain scan, the shard reader, two branches merged
into one tree, and generation with the store lossless at T = 0 (and faster when it holds the answer)."""
import random

import numpy as np
import pytest

import dominotree as dt
from conftest import random_drafter
from dominotree.train.data import Sequence, write_shard
from dominotree.trees.datastore import SEP, Datastore, load_store, lookup_reference, resolve_store, shard_responses
from dominotree.trees.lookup import merge_branch
from dominotree.trees.tree import DraftTree
from helpers import reference_sequence
from test_lookup import check_valid, paths


@pytest.mark.parametrize("seed", range(6))
def test_lookup_equals_a_plain_scan(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 4, 7])
    seqs = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 40))] for _ in range(rng.randrange(1, 25))]
    store = Datastore.from_sequences(seqs)
    for _ in range(300):
        ctx = [rng.randrange(vocab + 1) for _ in range(rng.randrange(1, 14))]
        k, min_n = rng.randrange(0, 10), rng.choice([1, 2, 4])
        assert store.lookup(ctx, k, min_n) == lookup_reference(seqs, ctx, k, min_n), (seqs, ctx, k, min_n)


def test_lookup_takes_the_longest_match_and_the_majority_continuation():
    store = Datastore.from_sequences([[1, 2, 3, 4], [9, 2, 3, 5, 6], [7, 2, 3, 5, 8], [1, 2, 3, 4, 4]])
    assert store.lookup([2, 3], 3, 2) == [4, 4]         # 4 and 5 tie at two votes: the smaller id; one 4 goes on
    assert store.lookup([9, 2, 3], 4, 2) == [5, 6]      # the 3-token match has one occurrence
    assert store.lookup([1, 2, 3], 3, 2) == [4, 4]      # two occurrences; one ends after 4, the other goes on
    assert store.lookup([0, 2, 3], 3, 3) == []          # a 2-token match is below min_n = 3
    assert store.lookup([0, 0], 3, 2) == []             # no match
    assert store.lookup([5], 3, 2) == []                # shorter than min_n
    assert store.lookup([2, 3], 0, 2) == []
    assert Datastore.from_sequences([]).lookup([1, 2], 3, 1) == []


def test_ties_go_to_the_smaller_token_and_no_continuation_crosses_a_response():
    store = Datastore.from_sequences([[5, 6, 9], [5, 6, 8], [3, 5, 6]])
    assert store.lookup([5, 6], 4, 2) == [8]            # 8 and 9 tie at one vote; [3, 5, 6] ends there
    with pytest.raises(ValueError, match="min_n"):
        store.lookup([5, 6], 4, 0)
    with pytest.raises(ValueError, match="lookup_store_min_n"):
        dt.SpecConfig(method="dominotree", lookup=4, lookup_store="train-data", lookup_store_min_n=9)


def test_shard_responses_drop_the_prompts(tmp_path):
    seqs = [Sequence(np.array([1, 2, 3, 10, 11]), 3, "a"), Sequence(np.array([4, 20]), 1, "b"),
            Sequence(np.array([5, 6]), 2, "c")]
    write_shard(tmp_path / "shard_00000.npz", seqs[:2])
    write_shard(tmp_path / "shard_00001.npz", seqs[2:])
    assert shard_responses(tmp_path).tolist() == [10, 11, SEP, 20, SEP, SEP]
    with pytest.raises(FileNotFoundError, match="no training shards"):
        shard_responses(tmp_path / "missing")


def test_the_store_names_resolve_or_fail_clearly(tmp_path):
    assert resolve_store("train-data", "smollm2-135m").name == "smollm2-135m"
    assert (resolve_store("train-data", "smollm2-135m") / "shard_00000.npz").exists()
    with pytest.raises(FileNotFoundError, match="no committed training data"):
        resolve_store("train-data", "no-such-model")
    with pytest.raises(FileNotFoundError, match="not a directory of training shards"):
        resolve_store(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="lookup_store adds a second lookup branch"):
        dt.SpecConfig(method="dominotree", lookup_store="train-data")


@pytest.mark.parametrize("seed", range(30))
def test_a_second_branch_never_drops_the_first(seed):
    rng = random.Random(seed)
    V = 4
    tokens, parents, used, size = [9], [-1], {0: set()}, rng.randrange(3, 14)
    while len(tokens) < size:
        p = rng.randrange(len(tokens))
        free = sorted(set(range(V)) - used[p])
        if free:                                     # siblings are distinct tokens
            tokens.append(rng.choice(free))
            parents.append(p)
            used[p].add(tokens[-1])
            used[len(tokens) - 1] = set()
    tree = DraftTree.from_lists(tokens, parents, [0.0] + [-rng.random() * 5 for _ in range(1, len(tokens))])
    first = [rng.randrange(V) for _ in range(rng.randint(1, 5))]
    second = [rng.randrange(V) for _ in range(rng.randint(1, 5))]
    half = (len(tree) - 1) // 2
    once, n1 = merge_branch(tree, first, max_new=half)
    twice, n2 = merge_branch(once, second, max_new=max(half - n1, 0), keep=first)
    check_valid(twice)
    assert len(twice) == len(tree) and n1 + n2 <= max(half, 0)
    assert {p for p in paths(once) if p == tuple(first[:len(p)])} <= paths(twice)   # the first branch stays
    kept_second = max((len(p) for p in paths(twice) if p == tuple(second[:len(p)])), default=0)
    assert n2 == 0 or kept_second >= 1
    # the new nodes of both branches are the last ones, the second's after the first's
    tail = {tuple(twice.tokens[j].item() for j in twice.path(i)[1:]) for i in range(len(twice) - n2, len(twice))}
    assert tail == paths(twice) - paths(once)


def store_dir(tmp_path, responses):
    tmp_path.mkdir(parents=True, exist_ok=True)
    write_shard(tmp_path / "shard_00000.npz", [Sequence(np.array([1] + r), 1, "test") for r in responses])
    load_store.cache_clear()
    return str(tmp_path)


@pytest.mark.parametrize("method", ["dflash", "dominotree"])
def test_store_branch_is_lossless_and_gets_accepted(tiny_target, tmp_path, method):
    prompt = [1, 11, 12, 13]
    ref, plain = reference_sequence(tiny_target, prompt, 40)
    answer = ref[len(prompt):]
    drafter = random_drafter(method == "dominotree", seed=3)
    kw = dict(method=method, max_new_tokens=40, budget=6, lookup=6, lookup_store_min_n=2)
    without = dt.generate(tiny_target, drafter, prompt, **kw)
    # the store holds this answer (as if the target had written it for another prompt) among junk
    rng = random.Random(0)
    junk = [[rng.randrange(2, 120) for _ in range(30)] for _ in range(20)]
    out = dt.generate(tiny_target, drafter, prompt, lookup_store=store_dir(tmp_path / "a", junk + [answer]), **kw)
    assert without.token_ids == plain.token_ids and out.token_ids == plain.token_ids
    assert out.stats["store_accepted"] > 0 and "store_accepted" not in without.stats
    assert out.stats["tau"] > without.stats["tau"]
    # a store of junk changes nothing but what is drafted: still the plain tokens
    junk_only = dt.generate(tiny_target, drafter, prompt, lookup_store=store_dir(tmp_path / "b", junk), **kw)
    assert junk_only.token_ids == plain.token_ids
