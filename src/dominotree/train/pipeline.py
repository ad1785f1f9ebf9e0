"""`dominotree train data | subset | features | dflash | domino | average | eval | all`: the reproducible drafter recipe.

`train all` runs every stage for the embedded target with the defaults below and copies the
final drafters to checkpoints/. Each stage resumes where it stopped."""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from ..config import int_list
from .precision import CHOICES, resolve_precision

# The recipe for SmolLM2-135M (30 layers, hidden 576), sized for a 2-core CPU (see docs/TRAINING.md).
# Both drafters use shift_label (block position d predicts depth d + 1: 16 depths per block), so the
# Domino run can start from the trained DFlash backbone.
RECIPE = dict(layer_ids=[1, 14, 27], num_layers=2, block_size=16, emb_dim=128, gru_hidden_dim=256,
              prefix_len=1, shift_label=True, init_layers="random", gamma=7.0, topk=0, distill=0.0, dflash_steps=2000,
              domino_steps=700, seqs_per_step=8, anchors_per_seq=12)

# `train all`: the stages behind the bundled drafters, in order (run dir, trainer, overrides, start).
# The DFlash backbone first learns all 16 depths (gamma 7), then a second phase concentrates the loss
# on the first depths (gamma 2), which a probe showed lifts chain tau; the Domino head goes back to
# gamma 7 (its correction matters at the deeper depths; gamma 2 measured no better). The last two
# stages continue both drafters (the bundled ones ran them after `train data` had grown by 60%);
# the continued Domino run trains the final logits only: restarting the curriculum at lambda 1
# pulled the backbone away from its trained head (docs/TRAINING.md). The bundled Domino drafter is
# the continued head retrained alone on a DFlash backbone kept fixed, so its base logits are the
# DFlash drafter's and the head only adds the path correction. The last two stages ran once `train
# data` had written all 12,000 prompts: the DFlash backbone continued (new batch order), then the
# head retrained alone on it. The bundled pair (twenty-third session) continues that backbone for 6,000
# steps over the data grown to all 25,856 prompts (`grow_data`: `train data` and `train features`
# extend the store first) and trains the head alone on it from the previous head; the next two pairs
# (bundled in the twenty-fifth and twenty-sixth sessions) run that continuation once more each (6,000
# steps, lower rate, new batch order: it still underfitted) and the head again on each result.
STAGES = [
    ("dflash", "dflash", dict(steps=RECIPE["dflash_steps"], gamma=7.0, lr=1e-3), None),
    ("dflash_ft", "dflash", dict(steps=RECIPE["dflash_steps"], gamma=2.0, lr=5e-4), "dflash"),
    ("domino", "domino", dict(steps=RECIPE["domino_steps"], gamma=7.0, lr=1e-3), "dflash_ft"),
    ("dflash_ft2", "dflash", dict(steps=RECIPE["dflash_steps"], gamma=2.0, lr=5e-4), "dflash_ft"),
    ("domino_ft", "domino", dict(steps=500, gamma=7.0, lr=5e-4, no_curriculum=True), "domino"),
    ("dflash_ft3", "dflash", dict(steps=1200, gamma=2.0, lr=2e-4), "dflash_ft2"),
    ("domino_ft2", "domino", dict(steps=400, gamma=7.0, lr=2e-4, no_curriculum=True), "domino_ft"),
    ("domino_head", "domino", dict(steps=1000, gamma=7.0, lr=5e-4, freeze_backbone=True, head_from="domino_ft2"),
     "dflash_ft3"),
    ("domino_head2", "domino", dict(steps=1000, gamma=7.0, lr=3e-4, freeze_backbone=True), "domino_head"),
    ("dflash_ft4", "dflash", dict(steps=2000, gamma=2.0, lr=2e-4, seed=1), "dflash_ft3"),
    ("domino_head3", "domino", dict(steps=1000, gamma=7.0, lr=5e-4, freeze_backbone=True, head_from="domino_head2"),
     "dflash_ft4"),
    ("dflash_cap", "dflash", dict(steps=6000, gamma=2.0, lr=5e-4, seed=21, vocab_min_count=5, grow_data=True),
     "dflash_ft4"),
    ("domino_cap", "domino", dict(steps=800, gamma=7.0, lr=5e-4, seed=3, vocab_min_count=5, freeze_backbone=True,
                                  head_from="domino_head3"), "dflash_cap"),
    ("dflash_cap2", "dflash", dict(steps=6000, gamma=2.0, lr=3e-4, seed=23, vocab_min_count=5), "dflash_cap"),
    ("domino_cap2", "domino", dict(steps=800, gamma=7.0, lr=5e-4, seed=3, vocab_min_count=5, freeze_backbone=True,
                                   head_from="domino_cap"), "dflash_cap2"),
    ("dflash_cap3", "dflash", dict(steps=6000, gamma=2.0, lr=3e-4, seed=25, vocab_min_count=5), "dflash_cap2"),
    ("domino_cap3", "domino", dict(steps=800, gamma=7.0, lr=5e-4, seed=3, vocab_min_count=5, freeze_backbone=True,
                                   head_from="domino_cap2"), "dflash_cap3"),
]
BUNDLED = {"dflash_cap3": "smollm2-135m-dflash", "domino_cap3": "smollm2-135m-domino"}


def add_train_parser(sub) -> None:
    t = sub.add_parser("train", help="train drafters for a target (data, features, dflash, domino, all)")
    ts = t.add_subparsers(dest="stage", required=True)
    t.set_defaults(func=main)

    def common(sp):
        sp.add_argument("--model", default="smollm2-135m")
        sp.add_argument("--workdir", default="runs/smollm2-135m", help="data, features and runs live here")

    d = ts.add_parser("data", help="the target writes responses to the training prompts")
    common(d)
    d.add_argument("--num-prompts", type=int, default=12000)
    d.add_argument("--max-new-tokens", type=int, default=256)
    d.add_argument("--time-limit", type=float, default=None, help="stop starting new shards after N seconds")
    d.add_argument("--batch-size", type=int, default=64,
                   help="rows decoded together (the recipe's 64; 128 was no faster over 256-token answers on 2 cores)")
    d.add_argument("--no-seed", action="store_true",
                   help="generate every shard, even those committed under train_data/MODEL/ by an earlier run")

    s = ts.add_parser("subset", help="a workdir holding chosen shards of another's data (fresh data + replay)")
    common(s)
    s.add_argument("--shards", required=True,
                   help="shard ids or start:stop[:step] ranges of WORKDIR/data, e.g. 0:101:6,101:124")
    s.add_argument("--out", required=True, help="the subset's workdir (train features|dflash|domino --workdir OUT)")

    f = ts.add_parser("features", help="cache the target's tapped-layer features")
    common(f)
    f.add_argument("--layers", default=",".join(map(str, RECIPE["layer_ids"])))
    f.add_argument("--topk", type=int, default=RECIPE["topk"],
                   help="also cache the target's top-k (soft labels for --distill; the recipe's 0: none, the top-8 adds ~50%% to the pass)")
    f.add_argument("--precision", choices=CHOICES, default="auto",
                   help="the target's dtype for the pass (auto: bf16 with AMX or where a timed bf16 product is "
                        "clearly faster than fp32, as on an AMD EPYC: ~3.5x; else fp32)")
    f.add_argument("--add-topk", action="store_true", help="only add the top-k to the existing feature store")
    f.add_argument("--time-limit", type=float, default=None,
                   help="start no new batch after N seconds; the pass resumes where it stopped when run again")

    for name in ("dflash", "domino"):
        r = ts.add_parser(name, help=f"train a {name} drafter on the cached features")
        common(r)
        r.add_argument("--out", default=None, help=f"run dir (default WORKDIR/{name})")
        r.add_argument("--steps", type=int, default=RECIPE[f"{name}_steps"])
        r.add_argument("--lr", type=float, default=1e-3)
        r.add_argument("--seqs-per-step", type=int, default=RECIPE["seqs_per_step"])
        r.add_argument("--anchors-per-seq", type=int, default=RECIPE["anchors_per_seq"])
        r.add_argument("--seed", type=int, default=0, help="batch order and initialisation (a new seed: new batches)")
        r.add_argument("--init-from", default=None, help="start from this drafter checkpoint dir (its backbone; its head too for a domino run)")
        r.add_argument("--num-layers", type=int, default=RECIPE["num_layers"],
                       help="draft layers (more than --init-from's: the new ones start as the identity)")
        r.add_argument("--layers", default=None,
                       help="target layers tapped, a subset of the feature store's (default: all of them; "
                            "taps --init-from lacks start with zero weight)")
        r.add_argument("--anchor-fusion", action="store_true",
                       help="also add the context feature before each root to the block inputs (EAGLE-style; "
                            "not in the published DFlash layout; from --init-from without it, it starts at zero)")
        r.add_argument("--init-layers", choices=["random", "target"], default=RECIPE["init_layers"],
                       help="draft layers start random or as the target's last layers")
        r.add_argument("--distill", type=float, default=RECIPE["distill"],
                       help="weight of the target's top-k soft labels in the loss (needs features --topk)")
        r.add_argument("--gamma", type=float, default=RECIPE["gamma"], help="per-depth loss decay exp(-(d-1)/gamma)")
        r.add_argument("--precision", choices=CHOICES, default="auto",
                       help="bf16 autocast or plain fp32; auto: bf16 with AMX or where a timed bf16 product is clearly "
                            "faster (an AMD EPYC: 2x per step), else fp32 (a Xeon without AMX: bf16 slower)")
        r.add_argument("--vocab", choices=["data", "full"], default="data",
                       help="softmax of the loss over the tokens seen in the data (fast) or the whole vocabulary")
        r.add_argument("--time-limit", type=float, default=None,
                       help="stop (state saved) after the step that passes N seconds; the same command continues it")
        r.add_argument("--vocab-min-count", type=int, default=1,
                       help="with --vocab data: only tokens seen at least this often (labels rarer than that "
                            "are ignored; a narrower softmax makes a step faster on large data)")
        r.add_argument("--vocab-top", type=int, default=0,
                       help="with --vocab data: only the N tokens the responses hold most often, the set "
                            "`draft_vocab=N` drafts from (0: no cap); other labels are ignored")
        if name == "domino":
            r.add_argument("--no-head", action="store_true", help="ablation: backbone only")
            r.add_argument("--ttt", action="store_true", help="ablation: GRU fed its own drafts")
            r.add_argument("--no-curriculum", action="store_true", help="ablation: final-logit loss only")
            r.add_argument("--freeze-backbone", action="store_true",
                           help="train the head only, on the --init-from backbone kept fixed (e.g. a trained DFlash drafter)")
            r.add_argument("--head-from", default=None, help="the head's starting weights from this Domino checkpoint")
            r.add_argument("--emb-dim", type=int, default=RECIPE["emb_dim"])
            r.add_argument("--gru-hidden-dim", type=int, default=RECIPE["gru_hidden_dim"])
            r.add_argument("--prefix-len", type=int, default=RECIPE["prefix_len"],
                           help="pure_draft_prefix_len: depths <= N use the base logits only (1: the published "
                                "config; 0: the head corrects depth 1 too, from the GRU state of the root)")

    e = ts.add_parser("eval", help="held-out tau of drafters on the benchmark prompts (T=0)")
    e.add_argument("--model", default="smollm2-135m")
    e.add_argument("--drafters", required=True, help="comma list of bundled names or checkpoint dirs")
    e.add_argument("--method", default="auto", help="auto: the drafter's chain (domino if it has a head, else dflash)")
    e.add_argument("--datasets", default="mt-bench,humaneval,gsm")
    e.add_argument("--training-prompts", default=None, metavar="START:END",
                   help="instead of --datasets: training prompts START..END-1 (per mix group; a drafter trained "
                        "on --num-prompts N has seen those below N), to tell memorised from generalised tau")
    e.add_argument("--max-samples", type=int, default=3, help="first N prompts of each dataset")
    e.add_argument("--max-new-tokens", type=int, default=96)
    e.add_argument("--budget", type=int, default=16, help="for tree methods")
    e.add_argument("--draft-vocab", type=int, default=0,
                   help="draft from the N tokens the target writes most (generate --draft-vocab; 0: all)")
    e.add_argument("--draft-vocab-source", default="train-data", help="responses that rank them (see generate)")
    e.add_argument("--out", default=None, help="write the rows and the table as JSON here")

    v = ts.add_parser("average", help="the weighted mean of checkpoints from one training lineage")
    v.add_argument("--drafters", required=True, help="comma list of bundled names or checkpoint dirs")
    v.add_argument("--weights", default=None, help="comma list, one per drafter (default: equal)")
    v.add_argument("--out", required=True, help="the averaged checkpoint's directory")

    a = ts.add_parser("all", help="data -> features -> dflash -> domino -> checkpoints/")
    common(a)
    a.add_argument("--num-prompts", type=int, default=12000)
    a.add_argument("--grown-prompts", type=int, default=25856,
                   help="the data the last stages train on (written and featurised once they are reached)")
    a.add_argument("--precision", choices=CHOICES, default="auto",
                   help="features and training (data is always written in bf16); auto: bf16 with AMX or where "
                        "a timed bf16 product is clearly faster than fp32, else fp32")


def _target(args):
    import dominotree as dt
    return dt.load_target(args.model, dtype="bf16")    # the data is written in bf16 on every CPU


def run_data(args, target=None):
    from .data import check_data_request, generate_data, seed_dir_for
    check_data_request(args.num_prompts, batch_size=getattr(args, "batch_size", 64),
                       max_new_tokens=getattr(args, "max_new_tokens", 256))
    target = target or _target(args)
    seed_dir = None if getattr(args, "no_seed", False) else seed_dir_for(args.model)
    generate_data(target, Path(args.workdir) / "data", num_prompts=args.num_prompts,
                  max_new_tokens=getattr(args, "max_new_tokens", 256), time_limit_s=getattr(args, "time_limit", None),
                  batch_size=getattr(args, "batch_size", 64), seed_dir=seed_dir)


def run_features(args, target=None):
    import dominotree as dt
    from ..target import DTYPES
    from .features import FeatureStore, build_feature_store, build_target_topk, recorded_precision
    root, topk = Path(args.workdir) / "features", getattr(args, "topk", RECIPE["topk"])
    layers = int_list(str(getattr(args, "layers", ",".join(map(str, RECIPE["layer_ids"])))), "--layers")
    precision = getattr(args, "precision", "auto")
    recorded = recorded_precision(root) if precision == "auto" else None
    if recorded:
        precision = recorded                       # continue the store's pass in its own precision
        print(f"target features: {precision}, as the store in {root} was started")
    dtype = DTYPES[resolve_precision(precision)]
    if target is None or target.dtype != dtype:     # `train all` hands over its bf16 data writer
        target = dt.load_target(args.model, dtype=dtype)
    if getattr(args, "add_topk", False):
        build_target_topk(target, FeatureStore(root), topk)
        return
    build_feature_store(target, Path(args.workdir) / "data", root, layers, topk=topk,
                        time_limit_s=getattr(args, "time_limit", None))


def run_train(args, name: str, target=None):
    from .dflash import TrainConfig, train
    from .features import FeatureStore
    head = name == "domino" and not getattr(args, "no_head", False)
    tc = TrainConfig(
        out=args.out or str(Path(args.workdir) / name), steps=args.steps, lr=getattr(args, "lr", 1e-3),
        seqs_per_step=getattr(args, "seqs_per_step", RECIPE["seqs_per_step"]),
        anchors_per_seq=getattr(args, "anchors_per_seq", RECIPE["anchors_per_seq"]),
        num_layers=getattr(args, "num_layers", RECIPE["num_layers"]),
        layer_ids=int_list(args.layers, "--layers") if getattr(args, "layers", None) else None,
        block_size=RECIPE["block_size"],
        head=head, shift_label=RECIPE["shift_label"], init_from=getattr(args, "init_from", None),
        emb_dim=getattr(args, "emb_dim", RECIPE["emb_dim"]), gru_hidden_dim=getattr(args, "gru_hidden_dim", RECIPE["gru_hidden_dim"]),
        ttt=getattr(args, "ttt", False), curriculum=not getattr(args, "no_curriculum", False),
        vocab=getattr(args, "vocab", "data"), vocab_min_count=getattr(args, "vocab_min_count", 1),
        vocab_top=getattr(args, "vocab_top", 0),
        init_layers=getattr(args, "init_layers", RECIPE["init_layers"]),
        gamma=getattr(args, "gamma", RECIPE["gamma"]), distill=getattr(args, "distill", RECIPE["distill"]),
        freeze_backbone=getattr(args, "freeze_backbone", False), head_from=getattr(args, "head_from", None),
        seed=getattr(args, "seed", 0), precision=resolve_precision(getattr(args, "precision", "auto")),
        anchor_fusion=getattr(args, "anchor_fusion", False),
        pure_draft_prefix_len=getattr(args, "prefix_len", RECIPE["prefix_len"]),
        time_limit_s=getattr(args, "time_limit", None))
    store = FeatureStore(Path(args.workdir) / "features")     # both checked before the target loads
    if train(target or _target(args), store, tc) is None:
        return None         # stopped at the time limit; the run dir holds the state to continue from
    return Path(tc.out) / "model"


def run_average(args) -> Path:
    from ..models import resolve_drafter
    from .average import average_checkpoints
    names = [n for n in args.drafters.split(",") if n]
    weights = [float(w) for w in args.weights.split(",")] if args.weights else [1.0] * len(names)
    out = average_checkpoints([resolve_drafter(n) for n in names], weights, Path(args.out))
    print(f"{out}: the mean of {', '.join(names)} with weights {weights}")
    return out


def main(args) -> int:
    if args.stage == "data":
        run_data(args)
    elif args.stage == "subset":
        from .subset import make_subset, parse_shards
        ids = parse_shards(args.shards)
        data = make_subset(Path(args.workdir) / "data", ids, Path(args.out))
        print(f"{data}: {len(ids)} shards of {Path(args.workdir) / 'data'}")
    elif args.stage == "features":
        run_features(args)
    elif args.stage == "average":
        run_average(args)
    elif args.stage == "eval":
        from .evaluate import main as eval_main
        return eval_main(args)
    elif args.stage in ("dflash", "domino"):
        run_train(args, args.stage)
    elif args.stage == "all":
        from ..models import checkpoints_dir
        target = _target(args)
        run_data(args, target)
        run_features(args, target)
        models = {}
        for run, trainer, overrides, start in STAGES:
            if overrides.get("grow_data") and args.grown_prompts > args.num_prompts:
                grown = argparse.Namespace(**{**vars(args), "num_prompts": args.grown_prompts})
                run_data(grown, target)
                run_features(grown, target)
            overrides = {k: v for k, v in overrides.items() if k != "grow_data"}
            if "head_from" in overrides:   # names an earlier stage
                overrides = {**overrides, "head_from": str(models[overrides["head_from"]])}
            ns = argparse.Namespace(**{**vars(args), **overrides}, out=str(Path(args.workdir) / run),
                                    init_from=str(models[start]) if start else None)
            models[run] = run_train(ns, trainer, target)
            if run in BUNDLED:
                dest = checkpoints_dir() / BUNDLED[run]
                if dest.exists():
                    shutil.rmtree(dest)
                shutil.copytree(models[run], dest)
                print(f"{run}: {dest}")
    return 0
