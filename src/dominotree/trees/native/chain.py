"""The Domino chain compiled (domino_chain.cpp): DominoDrafter.chain's tokens in one C++ call.

From Python the chain costs ~9-12 ms a round on the embedded drafter (~0.7 ms a depth, ~40 tensor
calls, several over the 49k-token vocabulary), more than the draft itself. Compiled, a depth is one
product for W2Bound's bound on every column, a pass that keeps the columns whose bound reaches the
best top-M candidate, and their exact products. The tokens are the argmax of base + W2 z over every
column, as the Python chain's (tests/test_native_chain.py: against its unpruned reference and a
brute-force loop); with a draft vocabulary it scans that vocabulary's compact columns, the only
tokens the widened rows leave finite. Where the native code cannot run (not compiled, CUDA, an
embedding module) the Python chain runs.
"""
from __future__ import annotations

import torch

from ...drafters.domino import W2Bound
from ..chain import domino_chain
from ..fast import HeadWeights, kept_root_row
from ..topk import topk_rows
from ..tree import DraftTree
from . import load, status

NO_IDS = torch.empty(0, dtype=torch.long)


def chain_columns(logits: torch.Tensor, hidden: torch.Tensor, ids: torch.Tensor | None, weights: HeadWeights,
                  bound: W2Bound, embed: torch.Tensor, root_token: int, prefix_len: int, depth: int,
                  topm: int = 64) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """(tokens, log-prob labels [depth], exactly scored columns per depth) of the chain over the
    columns of `logits` [>= depth, N] (token ids `ids`, or all tokens when None)."""
    if not load():
        raise RuntimeError(f"the native Domino chain is unavailable: {status()}")
    logits = logits[:depth].float().contiguous()
    w2, u, res_norms = bound.columns(ids)
    # no ids: the columns are the token ids (the C++ side reads an empty tensor so, no arange per round)
    col_ids = ids if ids is not None else NO_IDS
    cands = topk_rows(logits, min(topm, logits.shape[1]))[1]
    table = weights.table_for(embed)
    cols, logps, scored = torch.ops.dominotree_native.domino_chain(
        logits, cands, hidden[:depth].float(), weights.w1_h, weights.s_proj, w2, u, res_norms, bound.p,
        col_ids, table.table, table.ready, embed, weights.w_ih, table.block,
        kept_root_row(weights, embed, root_token), int(prefix_len), int(depth))
    return (cols if ids is None else ids[cols]).tolist(), logps, scored


def domino_chain_native(drafter, draft, root_token: int, target, depth: int, topm: int = 64) -> DraftTree:
    """trees/chain.domino_chain's tree, built in C++ where it can be."""
    embed = target.model.get_input_embeddings().weight
    if draft.hidden.is_cuda or embed.is_cuda or not load():
        return domino_chain(drafter, draft, root_token, target, depth, topm=topm)
    logits, ids = draft.scores()
    tokens, logps, _ = chain_columns(logits, draft.hidden, ids, drafter.tree_weights(), drafter.w2_bound(), embed,
                                     root_token, drafter.prefix_len, depth, topm)
    return DraftTree.chain(root_token, tokens, logps.cumsum(0))
