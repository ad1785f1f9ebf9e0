"""CaDDTree: a cost-aware adaptive budget, and the cost model it (and CondAdaptive) use.

theta(n) = (1 + phi(n)) / (C_draft + C_verify(n, ctx)), phi(n) = sum of exp(score) of the n
popped nodes (surrogate expected accepted draft tokens). Pop best-first and stop at the first
candidate that would not raise theta. C_verify is profiled on this machine (`dominotree
profile`) and fitted by a monotone convex least-squares curve per context length.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..config import check_int
from .ddtree import build_ddtree
from .dominotree import path_probability_stop
from .tree import DraftTree


def monotone_convex_fit(y) -> np.ndarray:
    """Least-squares fit of y (equally spaced) by a non-decreasing convex sequence.

    beta = a + b*i + sum_j c_j * max(0, i - j) with a, b, c >= 0 is exactly the set of
    non-negative, non-decreasing convex sequences, so the fit is one non-negative least squares."""
    from scipy.optimize import nnls
    y = np.asarray(y, dtype=np.float64)
    n = len(y)
    i = np.arange(n, dtype=np.float64)
    cols = [np.ones(n), i] + [np.maximum(0.0, i - j) for j in range(1, n - 1)]
    coef, _ = nnls(np.stack(cols, 1), y)
    return np.stack(cols, 1) @ coef


@dataclass
class CostModel:
    c_draft: float                                   # ms per round (draft + build)
    curves: dict[int, list[float]] = field(default_factory=dict)   # ctx -> C_verify(n) ms, n = 0..N

    def c_verify(self, n: int, ctx: int) -> float:
        ctxs = sorted(self.curves)
        vals = [self._at(self.curves[c], n) for c in ctxs]
        if ctx <= ctxs[0]:
            return vals[0]
        if ctx >= ctxs[-1]:
            return vals[-1]
        return float(np.interp(ctx, ctxs, vals))

    @staticmethod
    def _at(curve: list[float], n: int) -> float:
        n = max(n, 0)
        if n < len(curve):
            return curve[n]
        slope = curve[-1] - curve[-2] if len(curve) > 1 else 0.0
        return curve[-1] + slope * (n - len(curve) + 1)

    def save(self, path) -> None:
        Path(path).write_text(json.dumps({"c_draft": self.c_draft,
                                          "curves": {str(k): v for k, v in self.curves.items()}}, indent=1))

    @classmethod
    def load(cls, path) -> "CostModel":
        try:
            d = json.loads(Path(path).read_text())
            return cls(float(d["c_draft"]), {int(k): [float(x) for x in v] for k, v in d["curves"].items()})
        except (OSError, KeyError, ValueError, TypeError) as e:
            raise ValueError(f"{path}: not a cost model written by `dominotree profile` ({e})") from e

    @classmethod
    def fit(cls, c_draft: float, samples: dict[int, dict[int, list[float]]]) -> "CostModel":
        """samples: ctx -> n -> timings (ms) for n = 1..N. Cv(0) is clamped to Cv(1)."""
        curves = {}
        for ctx, by_n in samples.items():
            ns = sorted(by_n)
            med = [statistics.median(by_n[n]) for n in ns]
            fitted = monotone_convex_fit(med)
            curves[ctx] = [float(fitted[0])] + [float(v) for v in fitted]
        return cls(c_draft, curves)


def build_caddtree(logprobs: torch.Tensor, cost_model: CostModel, context_len: int,
                   max_budget: int = 64, root_token: int = 0, token_ids: torch.Tensor | None = None) -> DraftTree:
    """DDTree's pop order with the throughput stop rule (`token_ids`: as build_ddtree's)."""
    return build_ddtree(logprobs, max_budget, root_token, stop=path_probability_stop(cost_model, context_len),
                        token_ids=token_ids)


def profile(target, drafter, max_nodes: int = 64, contexts=(128, 512, 1024), repeats: int = 3,
            seed: int = 0, progress: bool = True, vocab=None) -> CostModel:
    """Measure C_verify(n, ctx) with random trees of n nodes (+ root) and C_draft, then fit.
    `vocab`: a DraftVocab the drafts are timed with (the `draft_vocab` the methods will run with)."""
    from tqdm import tqdm
    contexts = list(contexts)
    for name, value in (("max_nodes", max_nodes), ("repeats", repeats)):
        check_int(name, value, 1)
    if not contexts or len(set(contexts)) != len(contexts) or min(contexts) < 1:
        raise ValueError(f"contexts must be distinct lengths >= 1, got {contexts}")
    if max(contexts) + max_nodes + 1 > target.max_context:
        raise ValueError(f"a context of {max(contexts)} tokens and a tree of {max_nodes} nodes (+ root) exceed "
                         f"the target's context of {target.max_context}")
    g = torch.Generator().manual_seed(seed)
    V = target.vocab_size
    samples: dict[int, dict[int, list[float]]] = {}
    draft_times = []
    features = drafter is not None          # a drafter taps the target's features; verify returns them too
    target.set_taps(drafter.target_layer_ids if features else [])
    bar = tqdm(total=len(contexts) * max_nodes * repeats, desc="profile verify", disable=not progress)
    for ctx in contexts:
        prompt = torch.randint(3, V, (ctx,), generator=g)
        last = int(prompt[-1])
        pre = target.prefill(prompt, features=features)
        if features:
            drafter.reset()
            drafter.add_context(pre.features, 0)
            _timed_draft(drafter, last, ctx, target, vocab)     # warm-up
        trees = {}
        for n in range(1, max_nodes + 1):
            parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n + 1)]
            trees[n] = DraftTree.from_lists(torch.randint(3, V, (n + 1,), generator=g).tolist(), parents)
        samples[ctx] = {n: [] for n in trees}
        # warm-up: the first call of each shape is slow (oneDNN builds its kernels per input shape, and
        # every tree size is a new shape); an unwarmed size's median would carry that one-off cost, and
        # the monotone fit would spread a slow small size over every larger one
        for tree in trees.values():
            _timed_verify(target, tree, features)
        # one pass over every n per repeat: a burst of load from elsewhere hits one sample of many
        # sizes (which the median drops), not every sample of a few sizes (which it cannot); a draft
        # is timed before each verify, so its samples are spread over the whole profile the same way
        for _ in range(repeats):
            for n, tree in trees.items():
                if features:
                    draft_times.append(_timed_draft(drafter, last, ctx, target, vocab))
                samples[ctx][n].append(_timed_verify(target, tree, features))
                bar.update()
    bar.close()
    target.reset()
    c_draft = statistics.median(draft_times) if draft_times else 0.0
    return CostModel.fit(c_draft, samples)


def _timed_draft(drafter, last_token: int, ctx: int, target, vocab=None) -> float:
    """ms of one draft from the drafter's context of ctx tokens (drafting leaves that context as it was)."""
    t0 = time.perf_counter()
    drafter.draft(last_token, ctx, target, **({"vocab": vocab} if vocab is not None else {}))
    return (time.perf_counter() - t0) * 1e3


def _timed_verify(target, tree: DraftTree, features: bool) -> float:
    """ms of one tree verify; the target is put back as it was after (the verify is rolled back)."""
    t0 = time.perf_counter()
    target.verify(tree, features=features)
    ms = (time.perf_counter() - t0) * 1e3
    target.rollback()
    return ms
