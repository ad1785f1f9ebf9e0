"""summary.md, summary.csv and PNG plots, derived only from results.jsonl + run.json in a run dir.

Deterministic: the same files in give byte-identical files out (`dominotree bench --report-only`)."""
from __future__ import annotations

import csv
import json
import re
import sys
from pathlib import Path

from ..machine import describe
from .equality import opinions_note
from .metrics import ALL, BASELINE, STAGES, reference_method, summarize

RESULTS, RUN_INFO = "results.jsonl", "run.json"
CSV_COLUMNS = ["temperature", "dataset", "method", "n", "tau", "tok_s_median", "speedup", "ci_lo", "ci_hi",
               "ratio_of_means"] + [f"{s}_ms" for s in STAGES] + [
               "budget_mean", "lookup_share", "exact", "ties", "diverged", "p_vs_ref", "per_position"]


def read_run(out: Path) -> tuple[list[dict], dict]:
    out = Path(out)
    if not (out / RESULTS).is_file():
        raise FileNotFoundError(f"no {RESULTS} in {out}")
    records = read_records(out / RESULTS)
    info = json.loads((out / RUN_INFO).read_text()) if (out / RUN_INFO).is_file() else {}
    return records, info


def read_records(path: Path) -> list[dict]:
    """One record a line. A run stopped mid-write leaves a partial last line (no newline): it is
    left out, with a note, so the finished records still report; any other bad line is an error."""
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError as e:
            if n == len(lines):          # the last line, unterminated: a write cut short
                print(f"{path}: its last line is a partial record (the run stopped mid-write); left out",
                      file=sys.stderr)
                break
            raise ValueError(f"{path}:{n}: not a JSON record ({e})") from None
    return records


def problems(records: list[dict]) -> list[dict]:
    """T = 0 outputs that left `ar`'s tokens: near-ties and real divergences."""
    return [r for r in records if (r.get("equality") or {}).get("match") in ("tie", "diverged")]


def write_reports(out: Path, reference: str | None = None) -> tuple[list[dict], list[dict]]:
    """Write every report file; returns (summary rows, records). `reference` (a method label) sets the
    method the paired tests compare against and is kept in run.json, so later re-derivations agree."""
    out = Path(out)
    records, info = read_run(out)
    if reference is not None:
        reference_method(_labels(records), reference)          # a clear error before anything is written
        info["reference"] = reference
        (out / RUN_INFO).write_text(json.dumps(info, indent=1) + "\n")
    rows = summarize(records, info.get("reference"))
    (out / "summary.md").write_text(markdown(rows, records, info), encoding="utf-8")
    write_csv(rows, out / "summary.csv")
    plot(rows, records, out)
    return rows, records


def _labels(records: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["method"] for r in records))


def overall(rows: list[dict]) -> str:
    """The dataset whose rows cover the whole run: `all`, or the only dataset."""
    return ALL if any(r["dataset"] == ALL for r in rows) else rows[0]["dataset"]


def _f(x, fmt=".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _p(x) -> str:
    return "-" if x is None else f"{x:.2g}"


def markdown(rows: list[dict], records: list[dict], info: dict) -> str:
    ref = reference_method(_labels(records), info.get("reference"))
    lines = ["# dominotree bench", "", "Command (every option explicit):", "", f"    {info.get('command', '?')}", ""]
    for k in ("model", "dtype", "dflash_drafter", "domino_drafter", "cost_model"):
        if info.get(k):
            lines.append(f"- {k.replace('_', ' ')}: `{info[k]}`")
    if info.get("machine"):
        lines.append(f"- machine: {describe(info['machine'])}")
    if info.get("tree_builder"):
        lines.append(f"- DominoTree builder (unless a method's `builder=` says otherwise): {info['tree_builder']}")
    lines += ["", f"Speedup: mean over prompts of the paired ratio ({BASELINE} time per token) / (method time per "
              "token), with a 95% bootstrap CI; ratio of means: mean ar time per token / mean method time per "
              f"token. p: two-sided Wilcoxon signed-rank test on per-prompt time per token against "
              f"{f'`{ref}`' if ref else 'dominotree (not in this run)'}. "
              "Time: the whole call, text prompt in to tokens out (for the transformers peers too). tau includes "
              "the bonus token; stage ms are per round (draft/build/verify/commit); budget: mean chosen tree "
              "size of the adaptive methods; lookup: share of the emitted tokens that only a prompt-lookup branch "
              "(`lookup=N`) had proposed.", ""]
    for t in dict.fromkeys(r["temperature"] for r in rows):
        lines += [f"## Temperature {t}", "",
                  "| dataset | method | n | tau | tok/s | speedup [95% CI] | ratio of means | "
                  f"p vs {ref or 'dominotree'} | stage ms d/b/v/c | budget | lookup |", "|" + "---|" * 11]
        for r in (r for r in rows if r["temperature"] == t):
            stages = "/".join(_f(r[f"{s}_ms"], ".1f") for s in STAGES)
            ci = f"{_f(r['speedup'])}x [{_f(r['ci_lo'])}, {_f(r['ci_hi'])}]"
            lines.append(f"| {r['dataset']} | {r['method']} | {r['n']} | {_f(r['tau'])} "
                         f"| {_f(r['tok_s_median'], '.1f')} | {ci} | {_f(r['ratio_of_means'])}x "
                         f"| {_p(r['p_vs_ref'])} | {stages} | {_f(r['budget_mean'], '.1f')} "
                         f"| {_pct(r['lookup_share'])} |")
        lines.append("")
    lines += equality_section(rows, records, info)
    return "\n".join(lines) + "\n"


def equality_section(rows, records, info) -> list[str]:
    zero = [r for r in rows if r["temperature"] == 0 and r["method"] != BASELINE and r["dataset"] == overall(rows)]
    if not zero:
        return []
    lines = [f"## Equality with `{BASELINE}` at temperature 0 (tie tolerance {info.get('tie_tol', '?')})", ""]
    if "exact_steps" in info:
        lines += [("Exact steps: on (a verify's row and a one-token step of the same token give the same bits "
                   "here, so methods on the default fast paths are expected to give `ar`'s tokens exactly; a "
                   "near-tie on one of them means some step left those paths)." if info["exact_steps"] else
                   "Exact steps: off (this machine's verify rows and one-token steps may round differently: "
                   "near-ties can part a method from `ar`)."), ""]
    lines += ["| dataset | method | exact | near-ties | DIVERGED |", "|---|---|---|---|---|"]
    lines += [f"| {r['dataset']} | {r['method']} | {r['exact']} | {r['ties']} | {r['diverged']} |" for r in zero]
    lines.append("")
    for r in problems(records):
        e = r["equality"]
        kind = "near-tie" if e["match"] == "tie" else "**DIVERGED**"
        lines.append(f"- {kind}: `{r['method']}` on {r['dataset']}/{r['question_id']}: first difference at token "
                     f"{e['index']} (ar {e['expected']}, got {e['got']}), top-2 logit gap {e['gap']:.4g}"
                     + opinions_note(e))
    bad = sum(r["equality"]["match"] == "diverged" for r in problems(records))
    lines += ["", f"**FAILED: {bad} output(s) diverged from plain decoding beyond a near-tie.**" if bad
              else "All methods match plain decoding (up to near-ties).", ""]
    return lines


def write_csv(rows: list[dict], path: Path) -> None:
    def cell(k, v):
        if k == "per_position":
            return ";".join(f"{x:.6g}" for x in v)
        return "" if v is None else (f"{v:.6g}" if isinstance(v, float) else v)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(CSV_COLUMNS)
        w.writerows([[cell(k, r[k]) for k in CSV_COLUMNS] for r in rows])


# ------------------------------------------------------------------------------------ plots
def plot(rows: list[dict], records: list[dict], out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    temps = list(dict.fromkeys(r["temperature"] for r in rows))
    overall_ds = overall(rows)
    written = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=100, metadata={"Software": None})
        plt.close(fig)
        written.append(out / name)

    # speedup by dataset and method: grouped bars with CI whiskers, one panel per temperature
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4), squeeze=False, sharey=True)
    for ax, t in zip(axes[0], temps):
        sub = [r for r in rows if r["temperature"] == t and r["method"] != BASELINE and r["speedup"] is not None]
        dss, ms = list(dict.fromkeys(r["dataset"] for r in sub)), list(dict.fromkeys(r["method"] for r in sub))
        w = 0.8 / max(len(ms), 1)
        for j, m in enumerate(ms):
            pts = [(dss.index(r["dataset"]), r) for r in sub if r["method"] == m]
            ax.bar([i + j * w - 0.4 + w / 2 for i, _ in pts], [r["speedup"] for _, r in pts], w, label=m,
                   yerr=[[r["speedup"] - r["ci_lo"] for _, r in pts], [r["ci_hi"] - r["speedup"] for _, r in pts]],
                   capsize=2)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xticks(range(len(dss)), dss)
        ax.set_title(f"speedup vs {BASELINE}, T={t}")
    axes[0][0].set_ylabel("speedup (mean of per-prompt ratios)")
    if axes[0][-1].containers:      # none when ar is the only method
        axes[0][-1].legend(fontsize=7)
    save(fig, "speedup.png")

    # tau vs budget, for method families whose configured budget varies
    budgets = {r["method"]: (r.get("config") or {}).get("budget") for r in records}
    family = lambda m: re.sub(r"(?<=[:,])budget=\d+,?", "", m).rstrip(":,")   # label without its budget  # noqa: E731
    fams = {}
    for m, b in budgets.items():
        if b is not None:
            fams.setdefault(family(m), set()).add(b)
    varying = [f for f, bs in fams.items() if len(bs) > 1]
    if varying:
        fig, ax = plt.subplots(figsize=(6, 4))
        for f in varying:
            for t in temps:
                pts = sorted((budgets[r["method"]], r["tau"]) for r in rows if r["temperature"] == t
                             and r["dataset"] == overall_ds and family(r["method"]) == f and r["tau"] is not None)
                ax.plot(*zip(*pts), marker="o", label=f"{f} T={t}")
        ax.set_xscale("log", base=2)
        ax.set(xlabel="budget (tree nodes)", ylabel="tau (bonus included)", title=f"tau vs budget ({overall_ds})")
        ax.legend(fontsize=7)
        save(fig, "tau_vs_budget.png")
    else:       # an earlier run's budget sweep in this dir must not pass for this run's
        (out / "tau_vs_budget.png").unlink(missing_ok=True)

    # acceptance per position, one line per method
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4), squeeze=False, sharey=True)
    for ax, t in zip(axes[0], temps):
        for r in rows:
            if r["temperature"] == t and r["dataset"] == overall_ds and r["per_position"]:
                ax.plot(range(1, len(r["per_position"]) + 1), r["per_position"], marker=".", label=r["method"])
        ax.set(xlabel="draft depth d", title=f"acceptance per position ({overall_ds}), T={t}", ylim=(0, 1.02))
        if ax.lines:
            ax.legend(fontsize=7)
    axes[0][0].set_ylabel("P(at least d draft tokens accepted)\nover all rounds")
    save(fig, "acceptance.png")
    return written
