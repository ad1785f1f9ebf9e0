"""Chain proposals: the DFlash chain (argmax of the base logits per depth) and the Domino chain."""
from __future__ import annotations

import torch

from .tree import DraftTree


def dflash_chain(base_logits: torch.Tensor, root_token: int, depth: int) -> DraftTree:
    lp = torch.log_softmax(base_logits[:depth].float(), -1)
    best = lp.max(-1)
    return DraftTree.chain(root_token, best.indices.tolist(), best.values.cumsum(0))


def domino_chain(drafter, draft, root_token: int, target, depth: int, topm: int = 64,
                 pruned: bool = True) -> DraftTree:
    """The Python Domino chain (`pruned=False`: the reference, W2's full product per depth)."""
    tokens, logps = drafter.chain(draft, root_token, target, depth, topm=topm, pruned=pruned)
    return DraftTree.chain(root_token, tokens, torch.tensor(logps).cumsum(0))
