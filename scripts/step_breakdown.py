"""Where a target step's time goes on this CPU: a one-token step against a tree verify.

  python scripts/step_breakdown.py [--model smollm2-135m] [--context 390] [--nodes 16] [--reps 40]

Times, as medians of interleaved repetitions on a cache of --context tokens: the whole step
(a verify, rolled back after) with one node and with --nodes nodes; the same with every packed linear's output
replayed from a first call (what is left is the step's glue: norms, rotary, attention, the LM head,
Python); and the LM head alone. The difference between the two says what the linears cost at
each row count: on a 2-core CPU they are memory-bound at one row, so a 16-node verify's growth over
a one-token step is mostly in the glue, not in the products.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import dominotree as dt
import dominotree.lean_target as lean_target
from dominotree.trees.caddtree import _timed_verify
from dominotree.trees.tree import DraftTree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=390)
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()

    target = dt.load_target(args.model)
    target.set_taps([])
    target.prefill(list(range(10, 10 + args.context)), features=False)
    one = DraftTree.single(5)
    tree = DraftTree.from_lists(list(range(5, 5 + args.nodes)), [-1] + list(range(args.nodes - 1)))
    hidden = torch.randn(args.nodes, target.model.config.hidden_size).to(target.dtype)

    real = lean_target.packed_linear
    replayed: dict = {}

    def replay(x, w, b=None):       # each linear's first output again: the step without its products
        key = (tuple(x.shape), id(w))
        if key not in replayed:
            replayed[key] = real(x, w, b)
        return replayed[key]

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    # a verify is timed and rolled back (the profiler's own timer): every repetition sees the same cache
    cases = {
        "step, 1 node": lambda: _timed_verify(target, one, False),
        f"step, {args.nodes} nodes": lambda: _timed_verify(target, tree, False),
        "glue, 1 node": lambda: _timed_verify(target, one, False),
        f"glue, {args.nodes} nodes": lambda: _timed_verify(target, tree, False),
        "lm_head, 1 row": lambda: timed(lambda: target.lm_head(hidden[:1])),
        f"lm_head, {args.nodes} rows": lambda: timed(lambda: target.lm_head(hidden)),
    }
    times = {name: [] for name in cases}
    with torch.inference_mode():
        for _ in range(args.reps):
            for name, fn in cases.items():   # interleaved: drift hits every case alike
                lean_target.packed_linear = replay if name.startswith("glue") else real
                times[name].append(fn())
        lean_target.packed_linear = real
    if target._lean is None:
        print("note: the lean target path is off here, so 'glue' rows include the products")
    med = {name: statistics.median(v) for name, v in times.items()}
    for name, ms in med.items():
        print(f"{name:>20}: {ms:6.2f} ms")
    for n in (1, args.nodes):
        s = "node" if n == 1 else "nodes"
        print(f"{'linears, ' + str(n) + ' ' + s:>20}: {med[f'step, {n} {s}'] - med[f'glue, {n} {s}']:6.2f} ms")


if __name__ == "__main__":
    main()
