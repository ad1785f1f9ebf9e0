"""`dominotree bench`: every method side by side (placeholder parser until the harness lands)."""
from __future__ import annotations


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmark methods side by side")
    b.set_defaults(func=lambda args: main(args))


def main(args) -> int:
    raise ValueError("the benchmark harness is not available yet")
