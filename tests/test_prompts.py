"""Training prompts are offline, mixed, and disjoint from every benchmark prompt."""
import re
from collections import Counter

from dominotree.bench.datasets import DATASETS, load_dataset
from dominotree.offline_data import ASDIV_BENCH, asdiv
from dominotree.train.prompts import (EXTENSIONS, FROZEN, MIX, _extended, _first_prompts, codeio_prompts,
                                      more_instruction_prompts, source_group, training_prompts)


def _norm(s: str) -> str:
    return " ".join(s.lower().split())


def test_training_and_benchmark_prompts_are_disjoint():
    train = training_prompts()
    bench = [p for d in DATASETS for p in load_dataset(d)]
    assert len(bench) >= 80 + 164 + 100
    train_texts = {_norm(t) for _, t in train}
    assert not train_texts & {_norm(p.text) for p in bench}
    # no benchmark question (e.g. an ASDiv problem or an MT-Bench turn) hides inside a training prompt
    keys = [_norm(r["passage"] + " " + r["question"]) for r in asdiv()[:ASDIV_BENCH]]
    joined = "\n".join(train_texts)
    assert not any(k in joined for k in keys)
    for p in load_dataset("mt-bench") + load_dataset("aime"):
        assert _norm(p.text)[:80] not in joined
    for p in load_dataset("humaneval"):                 # nor a HumanEval docstring in a code request
        doc = _norm(max(re.split('"""|\x27\x27\x27', p.text)[1::2], key=len))
        assert len(doc) > 30 and doc[:60] not in joined


def test_aime_prompts_carry_the_problem_and_the_answer_format():
    rows = load_dataset("aime")
    assert len(rows) == 15 and len({p.question_id for p in rows}) == 15
    assert rows[0].text.startswith("Find the sum of all positive two-digit integers")
    assert all("integers ranging from 000 to 999" in p.text for p in rows)


def test_training_prompts_follow_the_mix():
    rows = training_prompts()[:4000]
    groups = Counter(source_group(s) for s, _ in rows)
    for g, share in MIX.items():
        assert abs(groups[g] / len(rows) - share) < 0.04
    assert len({t for _, t in rows}) == len(rows)


def test_a_slice_of_training_prompts_for_held_out_eval():
    import pytest
    from dominotree.train.evaluate import training_prompt_slice
    allp = training_prompts()
    rows = training_prompt_slice("100:130")
    assert [p.text for p in rows] == [t for _, t in allp[100:130]]
    assert [p.question_id for p in rows] == [str(i) for i in range(100, 130)]
    assert {p.dataset for p in rows} == {"train-instruction", "train-code", "train-math"}
    assert all(p.dataset == f"train-{source_group(p.category)}" for p in rows)
    for bad in ("5", "a:b", "10:10", "-1:4", f"0:{len(allp) + 1}"):
        with pytest.raises(ValueError, match="training-prompts"):
            training_prompt_slice(bad)


def test_prompts_past_the_committed_ones_restore_the_mix():
    first, allp = _first_prompts(0), training_prompts()
    assert allp[:FROZEN] == list(first[:FROZEN]) == training_prompts(0, FROZEN)    # the committed shards' prompts
    assert training_prompts(0, FROZEN + 10) == allp[:FROZEN + 10]
    head = Counter(source_group(s) for s, _ in allp[:FROZEN])
    assert head["math"] / FROZEN < 0.12                       # ASDiv ran out at prompt 7,063
    tail = [s for s, _ in allp[FROZEN:]]
    start = EXTENSIONS[1][0]                                  # the committed shards end here
    assert tail.count("gsm-symbolic") > 3900
    assert tail[:start - FROZEN] == ["gsm-symbolic"] * (start - FROZEN)   # maths first, it is furthest below its share
    assert len({t for _, t in allp}) == len(allp)
    # the second extension starts after the committed 19,968: it keeps them, and code takes CodeIO's
    # tasks first (its group is furthest below its share there), then the remaining instructions
    later = [s for s, _ in allp[start:]]
    assert later[:3000] == ["codeio"] * 3000 and "codeio" not in tail[:start - FROZEN]
    mix = Counter(source_group(s) for s in [s for s, _ in allp[:start]] + later[:3200])
    assert abs(mix["code"] / sum(mix.values()) - MIX["code"]) < 0.02
    rest = [r for r in allp[start:] if r[0] not in ("codeio", "gsm-symbolic")]
    older = [r for r in first[FROZEN:] if source_group(r[0]) == "instruction"]
    assert rest[:len(older)] == older                         # in their order (the third extension's follow)
    assert Counter(s for s, _ in allp)["codeio"] > 3200


def test_codeio_requests_name_the_reference_signature():
    rows = codeio_prompts()
    assert len(rows) > 3200 and len({t for _, t in rows}) == len(rows)
    assert sum("`main_solution(" in t and "Input:" in t and "Output:" in t for _, t in rows) > 0.95 * len(rows)
    assert {source_group(s) for s, _ in rows} == {"code"}


def test_the_third_extension_keeps_the_committed_prompts_and_adds_new_instructions():
    start = EXTENSIONS[2][0]                                 # the shards committed before it end here
    rows = _first_prompts(0)
    for at, group, pool in EXTENSIONS[:2]:
        rows = _extended(rows, at, group, pool())
    allp = training_prompts()
    assert allp[:start] == list(rows[:start])                # the committed shards' prompts are unchanged
    assert allp[start:len(rows)] == list(rows[start:])       # then the older pools' last instructions
    extra, older = more_instruction_prompts(), {t for _, t in rows}
    assert allp[len(rows):] == [r for r in extra if r[1] not in older]
    assert len({t for _, t in extra}) == len(extra) > 15000 and {source_group(s) for s, _ in extra} == {"instruction"}
    kinds = Counter(s for s, _ in extra[:2000])              # shuffled: any prefix mixes every source
    assert set(kinds) == {"open-qa", "reading", "exam", "story"} and min(kinds.values()) > 200
