"""Chooses the tree builder for a method, once per request: build(draft, root, start, max_depth)."""
from __future__ import annotations

from pathlib import Path

import torch

from ..config import ADAPTIVE_METHODS, SpecConfig
from .caddtree import CostModel, build_caddtree
from .chain import dflash_chain, domino_chain
from .ddtree import build_ddtree
from .dominotree import build_dominotree, path_probability_stop
from .fast import build_dominotree_fast
from . import native
from .native import build_dominotree_native
from .native.chain import domino_chain_native

TREE_BUILDERS = {"native": build_dominotree_native, "fast": build_dominotree_fast, "reference": build_dominotree}
# the Domino chain by the same choice: C++, the pruned Python chain, or W2's full product per depth
CHAIN_BUILDERS = {"native": domino_chain_native, "fast": domino_chain,
                  "reference": lambda *args, **kw: domino_chain(*args, pruned=False, **kw)}

DEFAULT_COST_MODEL = "cost_model.json"


def load_cost_model(cfg: SpecConfig, target) -> CostModel:
    from ..models import cache_dir
    path = Path(cfg.cost_model) if cfg.cost_model else cache_dir() / DEFAULT_COST_MODEL
    if not path.is_file():
        raise ValueError(f"method {cfg.method!r} needs a cost model; none at {path}. "
                         "Run `dominotree profile` first (or pass cost_model=PATH)")
    return CostModel.load(path)


def depth_cap(cfg: SpecConfig, drafter) -> int:
    """The deepest draft depth a request uses: the drafter's block, or `max_depth` if smaller."""
    return drafter.num_depths if cfg.max_depth is None else min(cfg.max_depth, drafter.num_depths)


def depths_needed(cfg: SpecConfig, drafter, max_depth: int) -> int:
    """How many depths of base logits a method's tree can use: a best-first tree of B nodes is at
    most B deep, so the LM head rows past that are never read."""
    depth = min(depth_cap(cfg, drafter), max_depth)
    if cfg.method in ("ddtree", "dominotree"):
        return min(depth, cfg.budget)
    if cfg.method in ADAPTIVE_METHODS:
        return min(depth, cfg.max_budget)
    return depth


def make_builder(cfg: SpecConfig, target, drafter):
    method = cfg.method
    cap = depth_cap(cfg, drafter)
    needs_head = method in ("domino", "dominotree", "condadaptive")
    if needs_head and not hasattr(drafter, "head"):
        raise ValueError(f"method {method!r} needs a Domino drafter (with a correction head); "
                         f"{drafter.name!r} is a plain DFlash drafter")
    cost = load_cost_model(cfg, target) if method in ADAPTIVE_METHODS else None
    if needs_head and cfg.builder == "native":
        native.load()   # compiled (first use only) before the first round, not inside its timing
    if needs_head and method != "domino":
        head32 = drafter.float_head()   # builders score in float32
        weights = drafter.tree_weights()
        embed_w = target.model.get_input_embeddings().weight
        tree_fn = TREE_BUILDERS[cfg.builder]
        if cfg.draft_vocab and tree_fn is not build_dominotree:
            from ..draft_vocab import draft_vocab_for
            weights.warm(embed_w, draft_vocab_for(target, cfg.draft_vocab, cfg.draft_vocab_source).ids)

    def build(draft, root: int, start: int, max_depth: int):
        depth = min(cap, max_depth)
        if method == "dflash":
            return dflash_chain(draft.base_logits, root, depth), {}
        if method == "domino":
            return CHAIN_BUILDERS[cfg.builder](drafter, draft, root, target, depth), {}
        logits, ids = draft.scores()      # compact rows over a draft vocabulary (ids None: all tokens)
        if method in ("ddtree", "caddtree"):
            lp = torch.log_softmax(logits[:depth], -1)
            if method == "ddtree":
                return build_ddtree(lp, cfg.budget, root, token_ids=ids), {}
            tree = build_caddtree(lp, cost, start, cfg.max_budget, root, token_ids=ids)
            return tree, {"budget": len(tree) - 1}
        stop, budget = None, cfg.budget
        if method == "condadaptive":
            stop, budget = path_probability_stop(cost, start), cfg.max_budget
        extra = {"weights": weights} if tree_fn is not build_dominotree else {}
        tree = tree_fn(logits, draft.hidden, head32, embed_w, root, budget, vocab_ids=ids,
                       node_topk=cfg.node_topk, corr_topm=cfg.corr_topm, normalization=cfg.normalization,
                       prefix_len=drafter.prefix_len, max_depth=depth, stop=stop,
                       conditioning=cfg.conditioning, **extra)
        return tree, ({"budget": len(tree) - 1} if method == "condadaptive" else {})

    return build
