"""Build time per round on the same recorded drafts: DominoTree's reference / fast / native tree
builders, or the Domino chain's reference (W2's full product) / fast (pruned Python) / native one.

Drafts are recorded from real rounds of the method on benchmark prompts; then each implementation
runs on each recorded draft, interleaved (the order rotates each repeat), and must return the
identical tree (the native one, when it is not compiled here, is left out). Reports medians and the
ratios (`dominotree bench --build-time`); a `dominotree` or `domino` spec in `--methods` (e.g.
`dominotree:budget=8,draft_vocab=8192`) picks what is timed and sets the rounds' options."""
from __future__ import annotations

import statistics
import time

import torch

from ..trees import native
from ..trees.chain import domino_chain
from ..trees.fast import HeadWeights, build_dominotree_fast
from ..trees.dominotree import build_dominotree
from ..trees.native.chain import domino_chain_native


def record_drafts(target, drafter, prompts, max_new_tokens=64, options=None, method="dominotree") -> list[tuple]:
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
            dt.generate(target, drafter, p, method=method, max_new_tokens=max_new_tokens, **(options or {}))
    finally:
        del drafter.draft
    return recorded


def _time(calls: dict, drafts, repeats: int, what: str) -> dict:
    """Median ms per draft of each call(draft, root) -> DraftTree, rotated per repeat; the trees
    must be the reference's."""
    times = {name: [] for name in calls}
    names = list(calls)
    for draft, root in drafts:
        trees = {}
        for order in range(repeats):
            for name in names[order % len(names):] + names[:order % len(names)]:
                t0 = time.perf_counter()
                with torch.inference_mode():
                    trees[name] = calls[name](draft, root)
                times[name].append((time.perf_counter() - t0) * 1e3)
        a = trees["reference"]
        for name, b in trees.items():
            if not (torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)):
                raise AssertionError(f"the {name} {what} returned a different tree than the reference")
    med = {f"{name}_ms": statistics.median(ts) for name, ts in times.items()}
    out = {"timed": what, "rounds": len(drafts), **med, "speedup": med["reference_ms"] / med["fast_ms"]}
    if "native_ms" in med:
        out["native_speedup"] = med["reference_ms"] / med["native_ms"]
    else:
        out["native"] = native.status()
    return out


def time_builders(target, drafter, drafts, budget=16, node_topk=8, corr_topm=64, repeats=3) -> dict:
    head = drafter.float_head()
    weights = HeadWeights(head)
    embed = target.model.get_input_embeddings().weight
    kw = dict(node_topk=node_topk, corr_topm=corr_topm, prefix_len=drafter.prefix_len)
    builders = {"reference": build_dominotree,
                "fast": lambda *a, **k: build_dominotree_fast(*a, weights=weights, **k)}
    if native.load():
        builders["native"] = lambda *a, **k: native.build_dominotree_native(*a, weights=weights, **k)
    for draft, _ in drafts:
        ids = draft.scores()[1]   # compact rows when the rounds drafted over a draft vocabulary
        if ids is not None:
            weights.warm(embed, ids)   # as the engine does once per request

    def call(build):
        def run(draft, root):
            logits, ids = draft.scores()
            return build(logits, draft.hidden, head, embed, root, budget, vocab_ids=ids, **kw)
        return run

    return {"budget": budget, **_time({name: call(b) for name, b in builders.items()}, drafts, repeats,
                                      "DominoTree builder")}


def time_chains(target, drafter, drafts, repeats=3) -> dict:
    """The Domino chain over each recorded draft's depths."""
    chains = {"reference": lambda *a: domino_chain(*a, pruned=False), "fast": domino_chain}
    if native.load():
        chains["native"] = domino_chain_native

    def call(chain):
        return lambda draft, root: chain(drafter, draft, root, target, draft.scores()[0].shape[0])

    return _time({name: call(c) for name, c in chains.items()}, drafts, repeats, "Domino chain")
