"""`dominotree generate | models | profile | train | bench | serve`.

Errors a user can fix (bad flags, unknown model, bad checkpoint) print one line on stderr and exit 2."""
from __future__ import annotations

import argparse
import json
import os
import sys

from . import __version__
from .config import METHODS, int_list, output_file


class UsageError(Exception):
    pass


def _load(args, need_drafter: bool):
    import dominotree as dt
    pack = not getattr(args, "no_pack", False)
    target = dt.load_target(args.model, dtype=getattr(args, "dtype", None), pack=pack,
                            gqa=not getattr(args, "no_gqa", False), lean=not getattr(args, "no_lean_target", False))
    drafter = None
    if need_drafter:
        drafter = dt.load_drafter(args.drafter, target=target, pack=pack)
    return target, drafter


def cmd_generate(args) -> int:
    import dominotree as dt
    need = args.method != "ar"
    if need and args.drafter is None:
        args.drafter = "smollm2-135m-dflash" if args.method in ("dflash", "ddtree", "caddtree") else "smollm2-135m-domino"
    # checked before the models load (seconds): a bad flag is refused at once
    cfg = dt.SpecConfig.from_kwargs(
        method=args.method, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, raw=args.raw, budget=args.budget, node_topk=args.node_topk,
        corr_topm=None if args.corr_topm <= 0 else args.corr_topm, builder=args.builder,
        stop=args.stop or [], cost_model=args.cost_model, lookup=args.lookup, lookup_ngram=args.lookup_ngram,
        lookup_store=args.lookup_store, lookup_store_min_n=args.lookup_store_min_n,
        draft_vocab=args.draft_vocab, draft_vocab_source=args.draft_vocab_source)
    target, drafter = _load(args, need)
    prompt = args.prompt if args.prompt != "-" else sys.stdin.read()
    if args.json:
        r = dt.generate(target, drafter, prompt, config=cfg)
        print(json.dumps({"text": r.text, "token_ids": r.token_ids, "stats": r.stats}))
        return 0
    from .detokenize import IncrementalText
    stream = dt.stream_generate(target, drafter, prompt, config=cfg)
    text = IncrementalText(target.decode, cfg.stop)
    for event in stream:    # print text as rounds commit
        sys.stdout.write(text.push(event.token_ids))
        sys.stdout.flush()
    sys.stdout.write(text.finish(stream.result.text))
    s = stream.result.stats
    print(f"\n\n[{s['method']}] {s['new_tokens']} tokens, {s['tokens_per_second']:.1f} tok/s, tau {s['tau']:.2f}, "
          f"{s['rounds']} rounds, finish: {s['finish_reason']}, stage ms/round: "
          + ", ".join(f"{k} {v:.1f}" for k, v in s["stage_ms"].items()), file=sys.stderr)
    return 0


def cmd_models(args) -> int:
    from .models import cache_dir, list_models
    rows = list_models()
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'name':24} {'kind':8} {'installed':10} description")
    for r in rows:
        print(f"{r['name']:24} {r['kind']:8} {'yes' if r['installed'] else 'no':10} {r['description']}")
    print(f"\ncache: {cache_dir()}")
    return 0


def cmd_profile(args) -> int:
    from .models import cache_dir
    from .trees.caddtree import profile
    contexts = int_list(args.contexts, "--contexts")
    out = output_file(args.out or cache_dir() / "cost_model.json", "--out")
    target, drafter = _load(args, True)
    vocab = None
    if args.draft_vocab:
        from .draft_vocab import draft_vocab_for
        vocab = draft_vocab_for(target, args.draft_vocab, args.draft_vocab_source)
    cm = profile(target, drafter, max_nodes=args.max_nodes, contexts=contexts,
                 repeats=args.repeats, vocab=vocab)
    cm.save(str(out))
    print(f"C_draft {cm.c_draft:.1f} ms; C_verify(1..{args.max_nodes}) at ctx {min(cm.curves)}: "
          f"{cm.c_verify(1, min(cm.curves)):.1f} .. {cm.c_verify(args.max_nodes, min(cm.curves)):.1f} ms -> {out}")
    return 0


def require_extra(extra: str, *modules: str) -> None:
    """A UsageError naming the pip extra when a command's optional dependencies are missing (at
    once, not after a long run: the bench's plots come last)."""
    import importlib
    missing = []
    for m in modules:
        try:
            importlib.import_module(m)
        except ImportError:
            missing.append(m)
    if missing:
        raise UsageError(f"this command needs {', '.join(missing)}: pip install 'dominotree[{extra}]'")


def cmd_bench(args) -> int:
    require_extra("bench", "matplotlib")
    from .bench import runner
    return runner.main(args)


def cmd_serve(args) -> int:
    require_extra("serve", "fastapi", "uvicorn")
    from . import serve
    return serve.main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dominotree", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"dominotree {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def model_flags(sp, drafter_default=None):
        sp.add_argument("--model", default="smollm2-135m", help="named target, local HF model dir or Hub id (owner/name)")
        sp.add_argument("--drafter", default=drafter_default, help="bundled drafter name, checkpoint dir or Hub id")
        sp.add_argument("--dtype", default=None, choices=["bf16", "fp32", "fp16"], help="target dtype (default: bf16, or fp32 on an x86 CPU without bf16 hardware)")
        sp.add_argument("--no-pack", action="store_true", help="plain transformers linears (no pre-packed weights)")
        sp.add_argument("--no-gqa", action="store_true", help="transformers' sdpa attention (not the packed GQA one)")
        sp.add_argument("--no-lean-target", action="store_true",
                        help="step the target on transformers' forward (not the lean path)")

    g = sub.add_parser("generate", help="generate text with a speculative method")
    model_flags(g)
    g.add_argument("prompt", help="the prompt (chat template applied unless --raw); '-' reads stdin")
    g.add_argument("--method", default="dominotree", choices=METHODS)
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--budget", type=int, default=16)
    g.add_argument("--node-topk", type=int, default=8)
    g.add_argument("--corr-topm", type=int, default=64, help="<= 0: the whole vocabulary")
    g.add_argument("--builder", default="native", choices=["native", "fast", "reference"],
                   help="DominoTree tree builder: native (C++, compiled on first use; the Python fast "
                        "builder where it cannot be), fast (Python) or reference (identical trees)")
    g.add_argument("--cost-model", default=None, help="JSON from `dominotree profile`")
    g.add_argument("--lookup", type=int, default=0,
                   help="merge a prompt-lookup branch of up to N tokens into each tree (0: off)")
    g.add_argument("--lookup-ngram", type=int, default=3, help="longest context suffix the lookup matches")
    g.add_argument("--lookup-store", default=None,
                   help="with --lookup: a second branch copied from text the target wrote before: 'train-data' "
                        "(the target's committed training responses) or a directory of training shards")
    g.add_argument("--lookup-store-min-n", type=int, default=4, help="shortest context suffix the store matches (1-8)")
    g.add_argument("--draft-vocab", type=int, default=0,
                   help="the drafter's LM head scores only the N tokens the target writes most often "
                        "(lossless; a cheaper draft). 0: the whole vocabulary")
    g.add_argument("--draft-vocab-source", default="train-data",
                   help="responses that rank the tokens: 'train-data' (the target's committed training "
                        "responses) or a directory of training shards")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("models", help="list named models and whether they are installed")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_models)

    pr = sub.add_parser("profile", help="measure verify/draft cost and fit the CaDDTree cost model")
    model_flags(pr, "smollm2-135m-domino")
    pr.add_argument("--max-nodes", type=int, default=64)
    pr.add_argument("--contexts", default="128,512,1024")
    pr.add_argument("--repeats", type=int, default=3)
    pr.add_argument("--draft-vocab", type=int, default=0,
                    help="time drafts with this draft vocabulary, as the adaptive methods will run (see generate)")
    pr.add_argument("--draft-vocab-source", default="train-data", help="responses that rank it (see generate)")
    pr.add_argument("--out", default=None)
    pr.set_defaults(func=cmd_profile)

    from .train.pipeline import add_train_parser
    add_train_parser(sub)
    from .bench.runner import add_bench_parser
    add_bench_parser(sub)
    sub.choices["bench"].set_defaults(func=cmd_bench)     # its extra checked before the run

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    model_flags(s)   # default drafter: chosen by the method, as in `generate`
    s.add_argument("--method", default="dominotree", choices=METHODS)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--cost-model", default=None,
                   help="JSON from `dominotree profile`, for --method caddtree|condadaptive (default: the cached one)")
    s.add_argument("--lookup", type=int, default=0, help="prompt-lookup branch of up to N tokens per tree (0: off)")
    s.add_argument("--lookup-store", default=None, help="with --lookup: a datastore branch too (see generate)")
    s.add_argument("--draft-vocab", type=int, default=0,
                   help="drafter LM head over the N tokens the target writes most (see generate; 0: all)")
    s.add_argument("--draft-vocab-source", default="train-data", help="responses that rank them (see generate)")
    s.set_defaults(func=cmd_serve)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from .drafters import DrafterLoadError
    from .models import ModelNotFoundError
    from .offline_data import DatasetUnavailable
    try:
        return args.func(args) or 0
    except BrokenPipeError:    # the reader went away (`| head`): stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no second error at exit
        return 141             # 128 + SIGPIPE
    except (ValueError, UsageError, ModelNotFoundError, DrafterLoadError, DatasetUnavailable, OSError) as e:
        print(f"dominotree: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
