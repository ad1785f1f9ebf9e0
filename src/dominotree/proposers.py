"""One proposer per method: (root token, start position, max depth) -> (DraftTree, stage ms, info).

The engine stays method-agnostic; everything method-specific is chosen here once per request."""
from __future__ import annotations

import time

from .config import SpecConfig
from .trees.tree import DraftTree


def make_proposer(cfg: SpecConfig, target, drafter):
    if cfg.method == "ar":
        return lambda root, start, max_depth: (DraftTree.single(root), {"draft": 0.0}, {})
    from .trees import builders
    build = builders.make_builder(cfg, target, drafter)
    vocab = {}
    if cfg.draft_vocab:
        from .draft_vocab import draft_vocab_for
        vocab = {"vocab": draft_vocab_for(target, cfg.draft_vocab, cfg.draft_vocab_source)}

    def propose(root: int, start: int, max_depth: int):
        t0 = time.perf_counter()
        draft = drafter.draft(root, start, target, depths=builders.depths_needed(cfg, drafter, max_depth), **vocab)
        t1 = time.perf_counter()
        tree, info = build(draft, root, start, max_depth)
        t2 = time.perf_counter()
        return tree, {"draft": (t1 - t0) * 1e3, "build": (t2 - t1) * 1e3}, info

    return propose
