"""`dominotree bench`: every method side by side on the same prompts, then tables and plots.

For each prompt and temperature all methods run back to back, so every speedup is a paired ratio
taken under the same machine load. Each output line goes to results.jsonl as it is produced; the
reports are derived from that file alone (`--report-only DIR` re-derives them byte for byte)."""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import shlex
import sys
import time
from pathlib import Path

import torch

from ..config import output_dir
from ..drafters.lean import module_path
from ..fp32_linear import status as fp32_linear_status
from ..gqa_attention import stock_attention
from ..lean_target import transformers_forward
from ..tree_attention import reference_attention, status as tree_attention_status
from ..trees.native import status as native_status
from ..machine import machine_info
from ..packed import packing
from .datasets import DATASETS, DEFAULT_DATASETS, Prompt, load_dataset
from .equality import opinions_note
from .methods import ALL_METHODS, PRESETS, expand_methods, run_hf_peer
from .metrics import BASELINE, reference_method
from .report import RESULTS, RUN_INFO, problems, write_reports

DEFAULT_DRAFTERS = {"dflash": "smollm2-135m-dflash", "domino": "smollm2-135m-domino"}


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmark methods side by side (paired speedups, tau, plots)",
                       description=__doc__.splitlines()[0])
    b.add_argument("--datasets", default=",".join(DEFAULT_DATASETS),
                   help=f"comma list from {', '.join(DATASETS)} (default: {','.join(DEFAULT_DATASETS)})")
    b.add_argument("--methods", default=None,
                   help=f"comma list of method specs name[:key=value,...] (names: {', '.join(ALL_METHODS)}); "
                        "e.g. dominotree:budget=32,corr_topm=16 or ddtree:drafter=domino. Default: all "
                        "(or only the preset's). `ar` is always included")
    b.add_argument("--preset", choices=list(PRESETS),
                   help="add a sweep: ladder (marginal tree on the Domino drafter -> correction once per depth -> "
                        "path-conditional), topm (corr_topm 8..64, full), budget (dominotree and ddtree at "
                        "8..128), norm (topm vs exact normalization)")
    b.add_argument("--temperatures", default="0", help="comma list, e.g. 0,0.5,1.0")
    b.add_argument("--max-samples", type=int, default=10, help="first N prompts of each dataset")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--budget", type=int, default=16, help="tree budget unless a method spec sets one")
    b.add_argument("--out", default=None, help="output directory")
    b.add_argument("--model", default="smollm2-135m", help="named target, local HF model dir or Hub id (owner/name)")
    b.add_argument("--dtype", default=None, choices=["bf16", "fp32", "fp16"], help="target dtype (default: bf16, or fp32 on an x86 CPU without bf16 hardware)")
    b.add_argument("--no-pack", action="store_true", help="plain transformers linears for every method (no pre-packed weights)")
    b.add_argument("--no-gqa", action="store_true", help="transformers' sdpa attention for every method (not the packed GQA one)")
    b.add_argument("--dflash-drafter", default=DEFAULT_DRAFTERS["dflash"], help="for dflash, ddtree, caddtree")
    b.add_argument("--domino-drafter", default=DEFAULT_DRAFTERS["domino"], help="for domino, dominotree, condadaptive")
    b.add_argument("--cost-model", default=None, help="cost model JSON for caddtree/condadaptive (default: "
                   "the profiled one in the cache for the default model, else profile once into DIR)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--warmup", type=int, default=1, help="untimed short generations per method before timing")
    b.add_argument("--tie-tol", type=float, default=0.25,
                   help="top-2 logit gap at or below which a T=0 divergence counts as a floating-point near-tie")
    b.add_argument("--reference", metavar="LABEL", default=None,
                   help="the method the paired tests compare every other against, as labelled in --methods "
                        "(default: dominotree, or its first variant); with --report-only, re-derives the tests")
    b.add_argument("--report-only", metavar="DIR", default=None,
                   help="re-derive summary.md, summary.csv and plots from DIR/results.jsonl")
    b.add_argument("--recheck", action="store_true",
                   help="with --report-only: run the equality check again on the outputs it had found diverged "
                        "(loads the run's target; for runs checked before its second opinion, see bench/equality.py)")
    b.add_argument("--build-time", action="store_true",
                   help="instead: DominoTree build ms per round, reference vs fast vs native builder (with a domino "
                        "spec in --methods: the Domino chain's), on drafts recorded from real rounds (identical trees "
                        "checked); writes DIR/build_time.json")
    b.add_argument("--prompts-file", default=None, help=argparse.SUPPRESS)   # JSONL of {text, ...} (tests)
    b.set_defaults(func=main)


def main(args) -> int:
    if args.recheck and not args.report_only:
        raise ValueError("--recheck goes with --report-only DIR")
    if args.report_only:
        if args.recheck:
            recheck(Path(args.report_only))
        _, records = write_reports(Path(args.report_only), args.reference)
        print(f"reports written to {args.report_only}", file=sys.stderr)
        return verdict(records)
    if not args.out:
        raise ValueError("bench needs --out DIR (or --report-only DIR)")
    specs = expand_methods(args.methods, args.preset)
    temps = _floats(args.temperatures, "--temperatures")
    if args.reference is not None:
        reference_method([s.label for s in specs], args.reference)     # fail before loading anything
    for flag, v, lo in (("--max-samples", args.max_samples, 1), ("--max-new-tokens", args.max_new_tokens, 1),
                        ("--budget", args.budget, 1), ("--warmup", args.warmup, 0), ("--tie-tol", args.tie_tol, 0)):
        if v < lo:
            raise ValueError(f"{flag} must be >= {lo}, got {v}")
    build_spec = build_time_options(args) if args.build_time else None   # fail before loading anything
    prompts = load_prompts(args)
    out = output_dir(args.out, "--out")

    import dominotree as dt
    target = dt.load_target(args.model, dtype=args.dtype, pack=not args.no_pack, gqa=not args.no_gqa)
    if args.build_time:
        return build_time(args, target, prompts, build_spec)
    names = {"dflash": args.dflash_drafter, "domino": args.domino_drafter}
    drafters = {k: dt.load_drafter(names[k], target=target, pack=not args.no_pack) for k in dict.fromkeys(s.drafter for s in specs) if k}
    cost_model = ensure_cost_model(args, target, drafters, specs, out)
    info = {"command": command_line(args), "model": args.model, "dtype": str(target.dtype).removeprefix("torch."),
            "packed": target.packed,
            "gqa_attention": target.gqa_attention, "lean_target": target.lean, "tree_attention": tree_attention_status(target.dtype),
            "exact_steps": target.exact_steps,
            "fp32_linear": fp32_linear_status() if target.dtype == torch.float32 else None,
            "lean_drafters": sorted(k for k, d in drafters.items() if d.lean() is not None),
            "tree_builder": native_status() if "domino" in drafters else None,
            "cost_model": cost_model, "tie_tol": args.tie_tol, "reference": args.reference, "machine": machine_info(),
            **{f"{k}_drafter": names[k] for k in drafters}}
    (out / RUN_INFO).write_text(json.dumps(info, indent=1) + "\n")

    encoded = [target.encode_prompt(p.text) for p in prompts]   # for the equality check
    warm_up(target, drafters, specs, prompts[0], temps[0], cost_model, args)
    run_all(target, drafters, specs, prompts, encoded, temps, cost_model, args, out / RESULTS)
    _, records = write_reports(out)
    print(f"results and reports in {out}", file=sys.stderr)
    return verdict(records)


def build_time(args, target, prompts, spec: tuple[str, dict]) -> int:
    import dominotree as dt
    from .build_time import record_drafts, time_builders, time_chains
    method, options = spec
    options = {"budget": args.budget, **options}
    cfg = dt.SpecConfig(method=method, **options)     # the knobs, defaults included
    drafter = dt.load_drafter(args.domino_drafter, target=target, pack=not args.no_pack)
    drafts = record_drafts(target, drafter, [p.text for p in prompts], args.max_new_tokens, options, method)
    if method == "domino":
        timed = time_chains(target, drafter, drafts)
    else:
        timed = time_builders(target, drafter, drafts, budget=cfg.budget, node_topk=cfg.node_topk,
                              corr_topm=cfg.corr_topm)
    res = {"command": command_line(args), "method": method, "options": options, **timed}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "build_time.json").write_text(json.dumps(res, indent=1) + "\n")
    native_part = (f", native {res['native_ms']:.2f} ms ({res['native_speedup']:.2f}x)" if "native_ms" in res
                   else f" (native: {res['native']})")
    size = f"budget {res['budget']}" if "budget" in res else "its depths"
    print(f"{res['timed']} per round over {res['rounds']} recorded rounds ({size}): reference "
          f"{res['reference_ms']:.2f} ms, fast {res['fast_ms']:.2f} ms ({res['speedup']:.2f}x){native_part}, "
          "identical trees")
    return 0


def build_time_options(args) -> tuple[str, dict]:
    """What --build-time times and the rounds' options: the one dominotree or domino spec in
    --methods (none: DominoTree at its defaults)."""
    if args.preset:
        raise ValueError("--build-time takes no --preset: give --methods one dominotree or domino spec instead")
    if args.methods is None:
        return "dominotree", {}
    specs = [s for s in expand_methods(args.methods, None) if s.method != "ar"]
    if len(specs) != 1 or specs[0].method not in ("dominotree", "domino"):
        raise ValueError("--build-time times DominoTree's builders or the Domino chain: give --methods one "
                         f"dominotree or domino spec (e.g. dominotree:budget=8,draft_vocab=8192), got {args.methods!r}")
    options = specs[0].config(args.budget)
    for key in ("normalization", "conditioning", "max_depth", "builder"):
        if key in options:
            raise ValueError(f"--build-time compares the builders at their defaults; {key} is not an option here")
    return specs[0].method, options


def _floats(text: str, flag: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes a comma list of numbers, got {text!r}") from None
    if not vals or any(not math.isfinite(v) or v < 0 for v in vals):
        raise ValueError(f"{flag} needs one or more finite temperatures >= 0, got {text!r}")
    return list(dict.fromkeys(vals))


def load_prompts(args) -> list[Prompt]:
    from ..offline_data import DatasetUnavailable
    if args.prompts_file:
        rows = prompts_file_rows(Path(args.prompts_file))
        allp = [Prompt(r.get("dataset", "custom"), str(r.get("question_id", i)), r.get("category", "custom"), r["text"])
                for i, r in enumerate(rows)]
    else:
        try:
            allp = [p for name in dict.fromkeys(d.strip() for d in args.datasets.split(",") if d.strip())
                    for p in load_dataset(name)]
        except DatasetUnavailable as e:
            raise ValueError(str(e)) from e
    return select_per_dataset(allp, args.max_samples)


def prompts_file_rows(path: Path) -> list[dict]:
    """The JSON objects of a --prompts-file, one a line, each with a non-empty "text"; a bad line is
    an error naming its number (before any model loads, not at that prompt's turn)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not a JSON line ({e})") from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str) or not row["text"].strip():
                raise ValueError(f"{path}:{n}: every line needs a JSON object with a non-empty \"text\" string")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no prompts (one JSON object with a \"text\" a line)")
    return rows


def select_per_dataset(allp: list[Prompt], max_samples: int) -> list[Prompt]:
    """The first max_samples prompts of each dataset, datasets in their first-seen order."""
    by_ds: dict[str, list[Prompt]] = {}
    for p in allp:
        if len(by_ds.setdefault(p.dataset, [])) < max_samples:
            by_ds[p.dataset].append(p)
    prompts = [p for ps in by_ds.values() for p in ps]
    if not prompts:
        raise ValueError("no benchmark prompts selected")
    return prompts


def command_line(args) -> str:
    """The command with every option explicit (reproduces the run)."""
    parts = ["dominotree", "bench"]
    for k, v in vars(args).items():
        skip = ("command", "func", "report_only") + (("datasets",) if args.prompts_file else ())
        if k in skip or v is None or v is False:
            continue
        parts += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return shlex.join(parts)


def ensure_cost_model(args, target, drafters, specs, out: Path) -> str | None:
    """caddtree/condadaptive need a cost model: the given one, the cached one (default model), or profile now."""
    adaptive = [s for s in specs if s.needs_cost_model]
    if not adaptive:
        return None
    if args.cost_model:
        if not Path(args.cost_model).is_file():
            raise FileNotFoundError(f"--cost-model {args.cost_model}: no such file")
        return args.cost_model
    from ..models import DEFAULT_TARGET, cache_dir
    cached = cache_dir() / "cost_model.json"
    if args.model == DEFAULT_TARGET and cached.is_file():
        return str(cached)
    from ..trees.caddtree import profile
    max_nodes = 48
    contexts = [c for c in (128, 512) if c + max_nodes + 1 < target.max_context] or [target.max_context // 4]
    print(f"no cost model for {args.model}: profiling verify cost (contexts {contexts}, up to {max_nodes} nodes)",
          file=sys.stderr)
    cm = profile(target, drafters[adaptive[0].drafter], max_nodes=max_nodes, contexts=contexts, repeats=2)
    path = out / "cost_model.json"
    cm.save(path)
    return str(path)


def run_one(target, drafters, spec, prompt: Prompt, temperature: float, cost_model, args,
            max_new_tokens: int | None = None) -> dict:
    """One timed generation (text in, tokens out) -> a results.jsonl record (equality verdict unset)."""
    import dominotree as dt
    n = max_new_tokens or args.max_new_tokens
    opts = spec.config(args.budget)
    if spec.needs_cost_model:
        opts["cost_model"] = cost_model
    stats = {}
    if spec.is_peer:
        tokens, wall = run_hf_peer(target, spec, prompt.text, temperature, n, args.seed)
        finish = "stop" if tokens and tokens[-1] in target.eos_token_ids else "length"
    else:
        drafter = drafters.get(spec.drafter)
        with contextlib.ExitStack() as stack:
            if not spec.packed:   # the same modules on their plain path: an interleaved A/B of packing
                for module in (target.model, getattr(drafter, "backbone", None), getattr(drafter, "head", None)):
                    if module is not None:
                        stack.enter_context(packing(module, False))
            if not spec.gqa:      # ... of the packed GQA attention
                stack.enter_context(stock_attention(target.model))
            if not spec.lean:     # ... of the drafter's lean path
                stack.enter_context(module_path(drafter))
            if not spec.lean_target:   # ... of the target's lean path
                stack.enter_context(transformers_forward(target))
            if not spec.tree_attention:   # ... of the tree-attention kernel
                stack.enter_context(reference_attention())
            t0 = time.perf_counter()
            res = dt.generate(target, drafter, prompt.text, method=spec.method, max_new_tokens=n,
                              temperature=temperature, seed=args.seed, **opts)
            wall = time.perf_counter() - t0
        tokens, stats, finish = res.token_ids, res.stats, res.stats["finish_reason"]
    return {
        "question_id": prompt.question_id, "category": prompt.category, "dataset": prompt.dataset,
        "method": spec.label, "base_method": spec.method, "temperature": temperature,
        "new_tokens": len(tokens), "wall_time": wall, "tokens_per_second": len(tokens) / wall if wall > 0 else 0.0,
        "accept_lengths": [a + 1 for a in stats.get("accepted_per_round", [])],
        "tau": stats.get("tau"), "rounds": stats.get("rounds"),
        "per_position_acceptance": stats.get("per_position_acceptance", []),
        "stage_ms": stats.get("stage_ms", {}), "budgets": stats.get("budgets", []),
        "lookup_accepted": stats.get("lookup_accepted"), "store_accepted": stats.get("store_accepted"),
        "finish_reason": finish, "config": opts, "token_ids": tokens, "text": target.decode(tokens), "equality": None,
    }


def warm_up(target, drafters, specs, prompt, temperature, cost_model, args) -> None:
    if args.warmup:
        print(f"warm-up: {args.warmup} short generation(s) per method", file=sys.stderr)
    for _ in range(args.warmup):
        for s in specs:
            run_one(target, drafters, s, prompt, temperature, cost_model, args, min(8, args.max_new_tokens))


def recheck(out: Path) -> int:
    """Run the equality check again on a finished run's diverged T = 0 outputs, with the run's own
    command line (prompts, tolerance) and target settings; rewrites results.jsonl. -> outputs rechecked."""
    from .equality import check
    from .report import read_run
    records, info = read_run(out)
    bad = [r for r in records if (r.get("equality") or {}).get("match") == "diverged"]
    if not bad:
        return 0
    parser = argparse.ArgumentParser(prog="dominotree")
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(shlex.split(info["command"])[1:])
    prompts = {(p.dataset, p.question_id): p for p in load_prompts(args)}
    import dominotree as dt
    # runs from before the lean target path record no "lean_target": their steps ran on transformers'
    target = dt.load_target(args.model, dtype=args.dtype, pack=info.get("packed", True),
                            gqa=info.get("gqa_attention", True), lean=info.get("lean_target", False))
    refs = {(r["dataset"], r["question_id"]): r["token_ids"] for r in records
            if r["method"] == BASELINE and r["temperature"] == 0}
    for r in bad:
        key = (r["dataset"], r["question_id"])
        ids = target.encode_prompt(prompts[key].text)
        r["equality"] = check(target, ids, refs[key], r["token_ids"], args.tie_tol)
    with open(out / RESULTS, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return len(bad)


def run_all(target, drafters, specs, prompts, encoded, temps, cost_model, args, path: Path) -> None:
    from tqdm import tqdm

    from .equality import check
    bar = tqdm(total=len(prompts) * len(temps) * len(specs), desc="bench", unit="gen", dynamic_ncols=True)
    with open(path, "w", encoding="utf-8") as f:
        for prompt, ids in zip(prompts, encoded):
            for t in temps:
                for spec in specs:            # `ar` first: the reference for the equality check
                    bar.set_postfix_str(f"{prompt.dataset}/{prompt.question_id} T={t} {spec.label}", refresh=False)
                    rec = run_one(target, drafters, spec, prompt, t, cost_model, args)
                    if spec.label == BASELINE:
                        ref = rec["token_ids"]
                    elif t == 0:
                        rec["equality"] = check(target, ids, ref, rec["token_ids"], args.tie_tol)
                    f.write(json.dumps(rec) + "\n")
                    f.flush()
                    bar.update()
    bar.close()


def verdict(records) -> int:
    """0 when every T = 0 output matched `ar` up to near-ties; else a loud message and 1."""
    found = problems(records)
    ties = [r for r in found if r["equality"]["match"] == "tie"]
    bad = [r for r in found if r["equality"]["match"] == "diverged"]
    if ties:
        print(f"{len(ties)} output(s) left plain decoding at a floating-point near-tie (see summary.md)",
              file=sys.stderr)
    if not bad:
        return 0
    bar = "!" * 78
    print(f"\n{bar}\nLOSSLESSNESS CHECK FAILED: {len(bad)} output(s) at temperature 0 diverged from plain "
          "decoding beyond a near-tie:", file=sys.stderr)
    for r in bad:
        e = r["equality"]
        print(f"  {r['method']} on {r['dataset']}/{r['question_id']}: token {e['index']}, top-2 gap {e['gap']:.4g}"
              + opinions_note(e), file=sys.stderr)
    print(bar, file=sys.stderr)
    return 1
