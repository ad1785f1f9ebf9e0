"""Statistics over benchmark records: paired speedups, bootstrap CIs, the Wilcoxon test, summary rows.

Records are the results.jsonl lines. Everything is a pure, seeded function of them, so a report
re-derived from the file is identical to the one written by the run."""
from __future__ import annotations

import math
import statistics

import numpy as np

BASELINE = "ar"
ALL = "all"
STAGES = ("draft", "build", "verify", "commit")


def bootstrap_ci(values, n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean (seeded, so deterministic)."""
    x = np.asarray(values, dtype=np.float64)
    if len(x) == 0:
        return math.nan, math.nan
    if len(x) == 1:
        return float(x[0]), float(x[0])
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), size=(n_boot, len(x)))].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def paired_ratio_ci(a, b, n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """mean(b) / mean(a) over paired samples, with a percentile bootstrap CI that resamples the pairs
    together (so what the two share, e.g. how hard a prompt is, cancels); seeded, so deterministic."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"paired_ratio_ci needs two paired 1-D samples, got shapes {x.shape} and {y.shape}")
    if len(x) == 0 or x.sum() == 0:
        return math.nan, math.nan, math.nan
    ratio = float(y.mean() / x.mean())
    idx = np.random.default_rng(seed).integers(0, len(x), size=(n_boot, len(x)))
    ratios = y[idx].mean(axis=1) / x[idx].mean(axis=1)
    lo, hi = np.quantile(ratios, [(1 - level) / 2, (1 + level) / 2])
    return ratio, float(lo), float(hi)


def wilcoxon_p(a, b) -> float | None:
    """Two-sided Wilcoxon signed-rank p-value for paired samples; None when it cannot be computed."""
    from scipy.stats import wilcoxon
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    if len(d) < 2 or not np.any(d):
        return None
    try:
        p = float(wilcoxon(d).pvalue)
    except ValueError:
        return None
    return None if math.isnan(p) else p


def time_per_token(r: dict) -> float:
    return r["wall_time"] / max(r["new_tokens"], 1)


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def survival(accepted: list[int]) -> list[float]:
    """P(at least d draft tokens accepted) for d = 1..max over the pooled rounds."""
    from ..engine import acceptance_survival
    return acceptance_survival(accepted, max(accepted, default=0))


def reference_method(labels: list[str], preferred: str | None = None) -> str | None:
    """The method the paired tests compare everything against: `preferred` (`bench --reference`), else
    `dominotree` (or its first variant)."""
    if preferred is not None:
        if preferred not in labels:
            raise ValueError(f"--reference {preferred!r} is not a method of this run; choose from {', '.join(labels)}")
        return preferred
    if "dominotree" in labels:
        return "dominotree"
    return next((m for m in labels if m.split(":")[0] == "dominotree"), None)


def _ordered(values):
    return list(dict.fromkeys(values))


def summarize(records: list[dict], reference: str | None = None) -> list[dict]:
    """One row per (temperature, dataset, method), datasets in run order plus `all` when > 1; p-values
    against `reference_method(labels, reference)`."""
    temps, datasets = _ordered(r["temperature"] for r in records), _ordered(r["dataset"] for r in records)
    labels = _ordered(r["method"] for r in records)
    ref = reference_method(labels, reference)
    key = lambda r: (r["dataset"], r["question_id"], r["temperature"])   # noqa: E731
    by = {(r["method"],) + key(r): r for r in records}
    rows = []
    for t in temps:
        for ds in datasets + ([ALL] if len(datasets) > 1 else []):
            for m in labels:
                group = [r for r in records if r["method"] == m and r["temperature"] == t
                         and (ds == ALL or r["dataset"] == ds)]
                if group:
                    rows.append(_row(t, ds, m, group, by, key, ref))
    return rows


def _lookup_share(group) -> float | None:
    """Share of the emitted tokens that only the prompt-lookup branch had proposed (None: no branch)."""
    rows = [r for r in group if r.get("lookup_accepted") is not None]
    total = sum(r["new_tokens"] for r in rows)
    return sum(r["lookup_accepted"] for r in rows) / total if total else None


def _row(t, ds, m, group, by, key, ref) -> dict:
    pairs = [(by[(BASELINE,) + key(r)], r) for r in group if (BASELINE,) + key(r) in by]
    ratios = [time_per_token(a) / time_per_token(r) for a, r in pairs]
    lo, hi = bootstrap_ci(ratios)
    mean_tpt = _mean([time_per_token(r) for _, r in pairs])
    budgets = [b for r in group for b in r.get("budgets") or []]
    eq = [(r.get("equality") or {}).get("match") for r in group]
    row = {
        "temperature": t, "dataset": ds, "method": m, "n": len(group),
        "tau": _mean([r["tau"] for r in group]),
        "tok_s_median": statistics.median(r["new_tokens"] / r["wall_time"] for r in group),
        "speedup": _mean(ratios), "ci_lo": lo, "ci_hi": hi,
        "ratio_of_means": (_mean([time_per_token(a) for a, _ in pairs]) / mean_tpt) if pairs else None,
        **{f"{s}_ms": _mean([(r.get("stage_ms") or {}).get(s) for r in group]) for s in STAGES},
        "budget_mean": _mean(budgets),
        "lookup_share": _lookup_share(group),
        "per_position": survival([a - 1 for r in group for a in r.get("accept_lengths") or []]),
        "exact": eq.count("exact"), "ties": eq.count("tie"), "diverged": eq.count("diverged"),
        "p_vs_ref": None,
    }
    if ref is not None and m != ref:
        mine = {key(r): r for r in group}
        other = [(by[(ref,) + k], r) for k, r in mine.items() if (ref,) + k in by]
        row["p_vs_ref"] = wilcoxon_p([time_per_token(a) for a, _ in other], [time_per_token(b) for _, b in other])
    return row
