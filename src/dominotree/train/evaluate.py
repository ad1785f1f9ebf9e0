"""`dominotree train eval`: held-out tau of drafter checkpoints on the benchmark prompts
(or, with `--training-prompts A:B`, on a slice of the training prompts).

Training prompts are disjoint from the benchmark's (tests/test_prompts.py), so this is the
number the training report quotes. tau needs no timing, so drafters run one after the other
without plain decoding alongside (`dominotree bench` is where outputs are checked against it)."""
from __future__ import annotations

import json
from statistics import mean

from tqdm import tqdm


def chain_method(drafter, method: str) -> str:
    if method != "auto":
        return method
    return "domino" if hasattr(drafter, "head") else "dflash"


def evaluate(target, drafters: dict, prompts, method: str = "auto", max_new_tokens: int = 96,
             budget: int = 16, progress: bool = True, draft_vocab: int = 0,
             draft_vocab_source: str = "train-data") -> list[dict]:
    """One row per (drafter, dataset) plus an "all" row each: mean per-prompt tau, and the per-prompt
    taus (`taus`, in the same order for every drafter, so they pair up; with `draft_vocab`, drafting
    from that many of the tokens the target writes most, as `generate` does)."""
    import dominotree as dt
    encoded = [target.encode_prompt(p.text) for p in prompts]
    rows = []
    bar = tqdm(total=len(drafters) * len(prompts), desc="held-out tau", disable=not progress)
    for name, drafter in drafters.items():
        m = chain_method(drafter, method)
        taus: dict[str, list[float]] = {}
        for p, ids in zip(prompts, encoded):
            r = dt.generate(target, drafter, ids, method=m, max_new_tokens=max_new_tokens, budget=budget,
                            draft_vocab=draft_vocab, draft_vocab_source=draft_vocab_source)
            taus.setdefault(p.dataset, []).append(r.stats["tau"])
            bar.update()
        for ds, t in taus.items():
            rows.append({"drafter": name, "method": m, "dataset": ds, "tau": mean(t), "prompts": len(t), "taus": t})
        every = [x for t in taus.values() for x in t]
        rows.append({"drafter": name, "method": m, "dataset": "all", "tau": mean(every), "prompts": len(every),
                     "taus": every})
    bar.close()
    return rows


def training_prompt_slice(spec: str, seed: int = 0) -> list:
    """Training prompts `A:B` (indices A..B-1 of the recipe's order, `train data`'s seed), as
    prompts labelled by their mix group: train-instruction, train-code, train-math. A drafter
    trained on `--num-prompts N` has seen the target's answers to the prompts below N and none above:
    tau on the two sides measures what it memorised against what it generalises."""
    from ..bench.datasets import Prompt
    from .prompts import source_group, training_prompts
    try:
        a, b = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"--training-prompts takes START:END (e.g. 16000:18000), got {spec!r}") from None
    if not 0 <= a < b:
        raise ValueError(f"--training-prompts {spec}: needs 0 <= START < END")
    allp = training_prompts(seed, b)
    if b > len(allp):
        raise ValueError(f"--training-prompts {spec}: needs END <= {len(allp)} (the training prompts)")
    return [Prompt(f"train-{source_group(src)}", str(i), src, text)
            for i, (src, text) in enumerate(allp[a:b], start=a)]


def comparisons(rows: list[dict]) -> list[dict]:
    """Each drafter after the first against the first, per dataset: the ratio of mean tau with a paired
    bootstrap 95% CI over the prompts, and the Wilcoxon signed-rank p-value. A bar such as "Domino chain
    >= 1.1x DFlash chain" is met when the CI's lower end clears it, and undecided while the CI holds it."""
    from ..bench.metrics import paired_ratio_ci, wilcoxon_p
    names = list(dict.fromkeys(r["drafter"] for r in rows))
    by = {(r["drafter"], r["dataset"]): r for r in rows}
    out = []
    for name in names[1:]:
        for ds in dict.fromkeys(r["dataset"] for r in rows if r["drafter"] == name):
            ref, mine = by.get((names[0], ds)), by[name, ds]
            if ref is None:
                continue
            ratio, lo, hi = paired_ratio_ci(ref["taus"], mine["taus"])
            out.append({"drafter": name, "versus": names[0], "dataset": ds, "prompts": mine["prompts"],
                        "ratio": ratio, "ci_lo": lo, "ci_hi": hi, "wilcoxon_p": wilcoxon_p(mine["taus"], ref["taus"])})
    return out


def markdown(rows: list[dict], pairs: list[dict] | None = None) -> str:
    """The tau table, then the comparison table (`pairs`: comparisons(rows), computed if not given)."""
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    lines = ["| drafter | method | " + " | ".join(datasets) + " |", "|---|---|" + "---|" * len(datasets)]
    for name in dict.fromkeys(r["drafter"] for r in rows):
        mine = {r["dataset"]: r for r in rows if r["drafter"] == name}
        method = next(iter(mine.values()))["method"]
        lines.append(f"| {name} | {method} | " + " | ".join(f"{mine[d]['tau']:.2f}" if d in mine else "-"
                                                        for d in datasets) + " |")
    pairs = comparisons(rows) if pairs is None else pairs
    if pairs:
        lines += ["", "| drafter | / | dataset | prompts | tau ratio [95% CI] | Wilcoxon p |", "|---|---|---|---|---|---|"]
        lines += [f"| {c['drafter']} | {c['versus']} | {c['dataset']} | {c['prompts']} | {c['ratio']:.3f}x "
                  f"[{c['ci_lo']:.3f}, {c['ci_hi']:.3f}] | "
                  + ("-" if c["wilcoxon_p"] is None else f"{c['wilcoxon_p']:.3g}") + " |" for c in pairs]
    return "\n".join(lines)


def main(args, target=None) -> int:
    import dominotree as dt
    from ..bench.runner import load_prompts, select_per_dataset
    from ..config import output_file
    out = output_file(args.out, "--out") if args.out else None     # not after the whole evaluation
    # bf16, as the drafters were trained and every reported tau was measured, on every CPU
    target = target or dt.load_target(args.model, dtype="bf16")
    args.prompts_file = getattr(args, "prompts_file", None)
    if getattr(args, "training_prompts", None):
        prompts = select_per_dataset(training_prompt_slice(args.training_prompts), args.max_samples)
    else:
        prompts = load_prompts(args)
    names = [d.strip() for d in args.drafters.split(",") if d.strip()]
    if not names:
        raise ValueError("--drafters needs at least one drafter name or checkpoint dir")
    drafters = {n: dt.load_drafter(n, target=target) for n in names}
    rows = evaluate(target, drafters, prompts, args.method, args.max_new_tokens, args.budget,
                    draft_vocab=getattr(args, "draft_vocab", 0),
                    draft_vocab_source=getattr(args, "draft_vocab_source", "train-data"))
    pairs = comparisons(rows)
    table = markdown(rows, pairs)
    print(table)
    if out is not None:
        out.write_text(json.dumps({"rows": rows, "comparisons": pairs, "markdown": table}, indent=2))
    return 0
