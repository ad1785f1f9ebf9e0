"""scripts/text_shards.py (the text probe): human-written answers, alternating code and prose,
and none of it a benchmark prompt or a HumanEval solution."""
import importlib.util
import re
from pathlib import Path

from dominotree.bench.datasets import load_dataset

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "text_shards.py"


def load_script():
    spec = importlib.util.spec_from_file_location("text_shards", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _norm(s: str) -> str:
    return " ".join(s.lower().split())


def test_pairs_alternate_code_and_prose_and_miss_every_benchmark_prompt():
    rows = load_script().pairs(seed=0)
    assert 1536 <= len(rows) <= 2000 and len(rows) % 2 == 0   # XSum articles (<= 1,000), each beside a CodeIO task
    assert [s for s, _, _ in rows[:4]] == ["text-code", "text-prose"] * 2
    assert all(p.strip() and a.strip() for _, p, a in rows)
    assert all(a.startswith("```python\n") for s, _, a in rows if s == "text-code")
    joined = "\n".join(_norm(p + " " + a) for _, p, a in rows)
    for ds in ("mt-bench", "gsm"):
        for q in load_dataset(ds):
            assert _norm(q.text)[:80] not in joined
    for q in load_dataset("humaneval"):          # no HumanEval docstring among the tasks or solutions
        doc = _norm(max(re.split('"""|\x27\x27\x27', q.text)[1::2], key=len))
        assert doc[:60] not in joined
    assert load_script().pairs(seed=0) == rows and load_script().pairs(seed=1) != rows
