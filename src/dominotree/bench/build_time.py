"""Tree build time per round, reference vs fast vs native builder, on the same recorded drafts.

Drafts are recorded from real DominoTree rounds on benchmark prompts; then the builders run on
each recorded draft, interleaved (the order rotates each repeat), and must return the identical
tree (the native one, when it is not compiled here, is left out). Reports medians and the ratios
(`dominotree bench --build-time`); a DominoTree spec in `--methods` (e.g.
`dominotree:budget=8,draft_vocab=8192`) sets the rounds' options, so the builders are timed on the
configuration a benchmark runs."""
from __future__ import annotations

import statistics
import time

import torch

from ..trees import native
from ..trees.fast import HeadWeights, build_dominotree_fast
from ..trees.dominotree import build_dominotree


def record_drafts(target, drafter, prompts, max_new_tokens=64, options=None) -> list[tuple]:
    """(DraftOutput, root) pairs from the rounds of real generations (`options`: generate's)."""
    import dominotree as dt
    recorded = []
    inner_draft = drafter.draft

    def spy(root, start, tgt, **kwargs):
        out = inner_draft(root, start, tgt, **kwargs)
        recorded.append((out, root))
        return out

    drafter.draft = spy
    try:
        for p in prompts:
            dt.generate(target, drafter, p, method="dominotree", max_new_tokens=max_new_tokens, **(options or {}))
    finally:
        del drafter.draft
    return recorded


def time_builders(target, drafter, drafts, budget=16, node_topk=8, corr_topm=64, repeats=3) -> dict:
    head = drafter.float_head()
    weights = HeadWeights(head)
    embed = target.model.get_input_embeddings().weight
    kw = dict(node_topk=node_topk, corr_topm=corr_topm, prefix_len=drafter.prefix_len)
    builders = {"reference": build_dominotree,
                "fast": lambda *a, **k: build_dominotree_fast(*a, weights=weights, **k)}
    if native.load():
        builders["native"] = lambda *a, **k: native.build_dominotree_native(*a, weights=weights, **k)
    times = {name: [] for name in builders}
    names = list(builders)
    for draft, root in drafts:
        logits, ids = draft.scores()   # compact rows when the rounds drafted over a draft vocabulary
        if ids is not None:
            weights.warm(embed, ids)   # as the engine does once per request
        trees = {}
        for order in range(repeats):
            for name in names[order % len(names):] + names[:order % len(names)]:
                t0 = time.perf_counter()
                with torch.inference_mode():
                    tree = builders[name](logits, draft.hidden, head, embed, root, budget, vocab_ids=ids, **kw)
                times[name].append((time.perf_counter() - t0) * 1e3)
                trees[name] = tree
        a = trees["reference"]
        for name, b in trees.items():
            if not (torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)):
                raise AssertionError(f"the {name} builder returned a different tree than the reference")
    med = {f"{name}_ms": statistics.median(ts) for name, ts in times.items()}
    out = {"rounds": len(drafts), "budget": budget, **med, "speedup": med["reference_ms"] / med["fast_ms"]}
    if "native_ms" in med:
        out["native_speedup"] = med["reference_ms"] / med["native_ms"]
    else:
        out["native"] = native.status()
    return out
