"""Top-k over vocabulary-long rows in two short passes.

torch.topk over [16, 49152] float32 logits costs ~1.5 ms on a 2-core CPU for k = 64 (~0.9 ms
for k = 16): a third of a DominoTree build and most of a DDTree build. The k largest entries of
a row lie in at most k blocks, and every such block is among the k blocks with the largest
maxima; so one top-k over the block maxima picks k blocks and a second over their k * block
entries picks the values (~0.6 ms for k = 64, ~0.3 ms for k = 16).

The values equal torch.topk's, sorted descending, and the indices point at them; among equal
values the index chosen may differ from torch.topk's (whose tie order is unspecified too). Rows
that are short next to k * block, rows not a whole number of blocks long, and CUDA tensors take
torch.topk itself.
"""
from __future__ import annotations

import torch

BLOCK = 64
MIN_SHRINK = 4   # the blocked pass pays when its k * block entries are a small part of a row


def topk_rows(x: torch.Tensor, k: int, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest entries of each row of x [R, V] (or [V]), descending."""
    if x.dim() == 1:
        values, indices = topk_rows(x[None], k, block)
        return values[0], indices[0]
    rows, vocab = x.shape
    k = min(k, vocab)
    if x.is_cuda or vocab % block or k * block * MIN_SHRINK > vocab:
        top = torch.topk(x, k, dim=-1)
        return top.values, top.indices
    blocks = x.reshape(rows, vocab // block, block)
    best_blocks = torch.topk(blocks.amax(-1), k, dim=-1, sorted=False).indices       # [R, k]
    picked = torch.gather(blocks, 1, best_blocks[..., None].expand(rows, k, block))
    values, pos = torch.topk(picked.reshape(rows, k * block), k, dim=-1)
    indices = torch.gather(best_blocks, 1, pos // block) * block + pos % block
    return values, indices
