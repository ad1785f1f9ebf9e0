"""Speculative methods are lossless at T = 0: chains and trees equal plain greedy decoding."""
import pytest
import torch

import dominotree as dt
from conftest import random_drafter
from helpers import ScriptedDrafter, reference_sequence, zero_head

PROMPTS = [[1, 11, 12, 13], [1, 40, 41], [1, 70, 71, 72, 73, 74]]
CHAIN = ["dflash", "domino"]
TREES = ["ddtree", "dominotree"]


def run(target, drafter, prompt, method, n=40, **kw):
    return dt.generate(target, drafter, prompt, method=method, max_new_tokens=n, **kw)


@pytest.mark.parametrize("method", CHAIN + TREES)
@pytest.mark.parametrize("kind", ["random", "oracle", "partly"])
def test_lossless_greedy(tiny_target, method, kind):
    domino = method in ("domino", "dominotree")
    for i, prompt in enumerate(PROMPTS):
        ref, plain = reference_sequence(tiny_target, prompt, 40)
        drafter = random_drafter(domino, seed=i)
        if kind != "random":
            if domino:
                zero_head(drafter) if kind == "oracle" else None
            drafter = ScriptedDrafter(drafter, ref, wrong_rate=0.0 if kind == "oracle" else 0.3, seed=i)
        out = run(tiny_target, drafter, prompt, method)
        assert out.token_ids == plain.token_ids, (method, kind, i)
        assert out.stats["finish_reason"] == plain.stats["finish_reason"]
        if kind == "oracle" and len(plain.token_ids) >= 30:
            # everything accepted: tau close to the drafter's depth + 1
            assert out.stats["tau"] >= 0.6 * (drafter.num_depths + 1), out.stats


@pytest.mark.parametrize("method", ["dflash", "ddtree", "dominotree"])
def test_qwen3_target_lossless(tiny_qwen3_target, method):
    prompt = [1, 11, 12, 13]
    ref, plain = reference_sequence(tiny_qwen3_target, prompt, 30)
    drafter = ScriptedDrafter(random_drafter(method != "ddtree"), ref, wrong_rate=0.3)
    assert run(tiny_qwen3_target, drafter, prompt, method, 30).token_ids == plain.token_ids


def _prompt_with_eos(target):
    for k in range(5, 90):
        r = dt.generate(target, None, [1, k], method="ar", max_new_tokens=40)
        if r.stats["finish_reason"] == "stop" and len(r.token_ids) >= 6:
            return [1, k], r
    pytest.skip("no prompt reaches EOS")


@pytest.mark.parametrize("method", CHAIN + TREES)
def test_eos_inside_an_accepted_block(tiny_target, method):
    prompt, plain = _prompt_with_eos(tiny_target)
    ref = prompt + plain.token_ids + [5] * 40          # the oracle proposes past the EOS
    drafter = ScriptedDrafter(zero_head(random_drafter(True)) if "domino" in method else random_drafter(False), ref)
    out = run(tiny_target, drafter, prompt, method)
    assert out.token_ids == plain.token_ids
    assert out.stats["finish_reason"] == "stop"
    assert out.token_ids.count(2) == 1


@pytest.mark.parametrize("method", CHAIN + TREES)
@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_max_new_tokens_mid_block(tiny_target, method, n):
    prompt = [1, 11, 12, 13]
    ref, plain = reference_sequence(tiny_target, prompt, 60)
    drafter = ScriptedDrafter(zero_head(random_drafter(True)) if "domino" in method else random_drafter(False), ref)
    out = run(tiny_target, drafter, prompt, method, n)
    assert out.token_ids == plain.token_ids[:n]
    assert len(out.token_ids) == min(n, len(plain.token_ids))


def test_stats_are_consistent(tiny_target):
    prompt = [1, 11, 12, 13]
    ref, plain = reference_sequence(tiny_target, prompt, 40)
    drafter = ScriptedDrafter(random_drafter(True), ref, wrong_rate=0.2)
    s = run(tiny_target, drafter, prompt, "dominotree").stats
    assert s["rounds"] == len(s["accepted_per_round"])
    # tokens: one from the prefill, then accepted + bonus per round (the last round may be cut)
    assert 1 + sum(a + 1 for a in s["accepted_per_round"]) >= s["new_tokens"]
    assert s["tau"] == pytest.approx((sum(s["accepted_per_round"]) + s["rounds"]) / s["rounds"])
    pp = s["per_position_acceptance"]
    assert all(0 <= p <= 1 for p in pp) and all(a >= b for a, b in zip(pp, pp[1:]))
    assert sum(pp) == pytest.approx(s["tau"] - 1)
    assert set(s["stage_ms"]) == {"draft", "build", "verify", "commit"}


def test_rounds_run_in_inference_mode_and_the_caller_does_not(tiny_target):
    stream = dt.stream_generate(tiny_target, random_drafter(True), [1, 11, 12, 13], method="dominotree",
                                max_new_tokens=24)
    inner, inside = stream.proposer, []
    stream.proposer = lambda *a: inside.append(torch.is_inference_mode_enabled()) or inner(*a)
    between = [torch.is_inference_mode_enabled() for _ in stream]
    assert inside and all(inside)
    assert between and not any(between)
    assert not torch.is_inference_mode_enabled()


def test_dflash_drafter_cannot_run_domino_methods(tiny_target):
    with pytest.raises(ValueError, match="Domino drafter"):
        run(tiny_target, random_drafter(False), [1, 5], "dominotree")


def test_drafter_that_does_not_fit_is_rejected(tiny_target):
    from conftest import drafter_config
    from dominotree.drafters import DrafterLoadError, build_drafter
    cfg = drafter_config(True)
    cfg.target_layer_ids = [1, 9]
    with pytest.raises(DrafterLoadError, match="beyond the target"):
        run(tiny_target, build_drafter(cfg), [1, 5], "domino")


@pytest.mark.parametrize("words_in_stop", [1, 2])
@pytest.mark.parametrize("method", ["ar", "dominotree"])
def test_streamed_tokens_stop_where_the_result_does(tiny_target, method, words_in_stop):
    """A round that finds a stop string is cut before its event goes out: the events never carry a
    token past the stop (they used to carry the whole round), and add up to the result. A stop
    string of two tokens may span rounds: its first token waits (it used to go out, and the result
    then dropped it)."""
    prompt = [1, 40, 41]
    ref, plain = reference_sequence(tiny_target, prompt, 40)
    drafter = ScriptedDrafter(zero_head(random_drafter(True)), ref, wrong_rate=0.0) if method != "ar" else None
    words = plain.text.split()
    # from the space before a word: the stop string begins at a token's start, so a cut there drops
    # that whole token (with the word-level tokenizer's joining spaces)
    grams = [" " + " ".join(words[i:i + words_in_stop]) for i in range(len(words))]
    stop = next(g for i, g in enumerate(grams[4:], 4) if g not in " ".join(words[:i + words_in_stop - 1]))
    stream = dt.stream_generate(tiny_target, drafter, prompt, method=method, max_new_tokens=40, stop=[stop])
    streamed = [t for event in stream for t in event.token_ids]
    assert stream.result.stats["finish_reason"] == "stop" and stop not in stream.result.text
    assert streamed == stream.result.token_ids == plain.token_ids[:len(streamed)]
    assert plain.text.startswith(stream.result.text)
    if method != "ar":
        assert stream.result.stats["tau"] > 2      # rounds of several tokens: the cut fell inside one


def test_a_stop_string_early_in_a_long_round_is_found(tiny_target):
    """Stop strings were looked for in a round's last 64 tokens: a round that accepted 100 tokens
    (a 100-token block here; a long lookup branch does it too) kept a stop string near its start
    and ran on to the length limit."""
    for k in range(5, 60):
        prompt = [1, k, k + 1]
        ref, plain = reference_sequence(tiny_target, prompt, 150)
        words = plain.text.split()
        once = [w for w in set(words[1:30]) if w not in words[30:101]]   # early in the round, only there
        if len(plain.token_ids) == 150 and once:
            break
    else:
        pytest.skip("no prompt gives a long answer with an early word that does not come back")
    stop = min(once, key=words.index)
    drafter = ScriptedDrafter(random_drafter(False, block_size=100), ref)
    r = run(tiny_target, drafter, prompt, "dflash", n=150, stop=[stop])
    assert r.stats["accepted_per_round"][0] == 99          # the stop string is in a 100-token round
    assert r.stats["finish_reason"] == "stop" and stop not in r.text
    assert plain.text.startswith(r.text) and r.token_ids == plain.token_ids[:len(r.token_ids)]


@pytest.mark.parametrize("method, options", [("ddtree", dict(budget=256)), ("dominotree", dict(budget=10**6)),
                                             ("caddtree", dict(max_budget=300)), ("condadaptive", dict(max_budget=256))])
def test_a_tree_larger_than_the_context_is_refused(tiny_target, tmp_path, method, options):
    """A verify attends over every node at once: a budget past the context (256 here) gets a clear
    error at once instead of a verify that exhausts memory; the largest budget that fits runs."""
    from dominotree.trees.caddtree import CostModel
    drafter = random_drafter(method != "ddtree")
    if method in ("caddtree", "condadaptive"):
        CostModel(c_draft=5.0, curves={0: [10.0 + 0.01 * n for n in range(300)]}).save(tmp_path / "cost.json")
        options = {**options, "cost_model": str(tmp_path / "cost.json")}
    with pytest.raises(ValueError, match="does not fit in one verify"):
        run(tiny_target, drafter, [1, 5], method, n=4, **options)
    fits = {**options, **{key: 255 for key in options if "budget" in key}}
    assert run(tiny_target, drafter, [1, 5], method, n=4, **fits).token_ids == \
        run(tiny_target, None, [1, 5], "ar", n=4).token_ids


@pytest.mark.parametrize("option", ["budget", "max_budget"])
@pytest.mark.parametrize("value", [0, 2.5])
def test_budgets_must_be_positive_integers(tiny_target, option, value):
    with pytest.raises(ValueError, match=option):
        run(tiny_target, random_drafter(True), [1, 5], "dominotree", n=4, **{option: value})


@pytest.mark.parametrize("method,budget", [("dflash", 16), ("domino", 16), ("ddtree", 3), ("dominotree", 3),
                                           ("dominotree", 5), ("caddtree", 16), ("condadaptive", 16)])
def test_drafts_keep_only_the_depths_a_tree_can_use(tiny_target, tmp_path, method, budget):
    """The proposer asks the LM head for min(depth, budget) rows; its trees equal those built from
    the full draft, and the full draft's extra rows are really dropped."""
    from dominotree.config import SpecConfig
    from dominotree.proposers import make_proposer
    from dominotree.trees import builders
    from dominotree.trees.caddtree import CostModel
    cost = tmp_path / "cost.json"
    CostModel(c_draft=5.0, curves={0: [10.0 + 0.5 * n for n in range(70)]}).save(cost)
    cfg = SpecConfig(method=method, budget=budget, cost_model=str(cost), max_budget=6)
    drafter = random_drafter(method in ("domino", "dominotree", "condadaptive"), seed=2)
    tiny_target.set_taps(drafter.target_layer_ids)
    prompt = torch.tensor([1, 11, 12, 13, 14])
    pre = tiny_target.prefill(prompt)
    drafter.reset()
    drafter.add_context(pre.features, 0)
    max_depth = 7
    need = builders.depths_needed(cfg, drafter, max_depth)
    expect = min(drafter.num_depths, max_depth, budget if method in ("ddtree", "dominotree") else 99,
                 6 if method in ("caddtree", "condadaptive") else 99)
    assert need == expect
    tree, _, _ = make_proposer(cfg, tiny_target, drafter)(14, len(prompt), max_depth)
    full = drafter.draft(14, len(prompt), tiny_target)
    assert drafter.draft(14, len(prompt), tiny_target, depths=need).base_logits.shape[0] == need
    ref, _ = builders.make_builder(cfg, tiny_target, drafter)(full, 14, len(prompt), max_depth)
    assert torch.equal(tree.tokens, ref.tokens) and torch.equal(tree.parents, ref.parents)
    tiny_target.rollback()


@pytest.mark.parametrize("method", ["ar", "dflash", "dominotree"])
def test_the_verify_kernel_is_ready_before_the_timed_rounds(tiny_target, monkeypatch, method):
    # its first use compiles it (~30 s): inside the rounds that would be counted as step time
    # (plain decoding's one-token steps use it too), for the target's dtype
    from dominotree import engine
    calls = []
    monkeypatch.setattr(engine.tree_attention, "enabled", lambda dtype=None: calls.append(dtype) or False)
    drafter = None if method == "ar" else random_drafter(method == "dominotree")
    stream = dt.stream_generate(tiny_target, drafter, [1, 11, 12, 13], method=method, max_new_tokens=8)
    assert calls == [tiny_target.dtype]
    list(stream)
    assert len(stream.result.token_ids) == 8
