"""DDTree: best-first draft trees from per-depth marginals (lazy sibling pushes).

The score of a node is the factorised cumulative log-prob sum_j lp[j, r_j] of its rank path.
Each pop pushes the popped node's next sibling and first child, so the heap never holds more
than two entries per popped node and the popped set is exactly the top-`budget` prefixes.
Ties go to the lexicographically smaller rank path (deterministic)."""
from __future__ import annotations

import heapq
from typing import Callable, Iterator

import torch

from .topk import topk_rows
from .tree import DraftTree


def ddtree_pops(logprobs: torch.Tensor, max_nodes: int,
                token_ids: torch.Tensor | None = None) -> Iterator[tuple[int, int, float, int]]:
    """Yield popped nodes in best-first order as (token, parent index, score, depth).

    Node indices are 1-based in pop order (0 is the root). A generator, so adaptive rules can stop.
    `token_ids`: the token of each logprobs column (a draft vocabulary; None: column j is token j)."""
    depth_limit, vocab = logprobs.shape
    if depth_limit == 0 or max_nodes <= 0:
        return
    k = min(max_nodes, vocab)
    top_lp, top_ids = topk_rows(logprobs.float(), k)
    if token_ids is not None:
        top_ids = token_ids[top_ids]
    lp, ids = top_lp.tolist(), top_ids.tolist()
    heap = [(-lp[0][0], (0,), 0, 1, 0, lp[0][0])]   # (-score, rank path, parent, depth, rank, score)
    count = 0
    while heap and count < max_nodes:
        _, ranks, parent, depth, rank, score = heapq.heappop(heap)
        count += 1
        yield ids[depth - 1][rank], parent, score, depth
        if rank + 1 < k:
            s = score - lp[depth - 1][rank] + lp[depth - 1][rank + 1]
            heapq.heappush(heap, (-s, ranks[:-1] + (rank + 1,), parent, depth, rank + 1, s))
        if depth < depth_limit:
            s = score + lp[depth][0]
            heapq.heappush(heap, (-s, ranks + (0,), count, depth + 1, 0, s))


def build_ddtree(logprobs: torch.Tensor, budget: int, root_token: int = 0,
                 stop: Callable[[int, float], bool] | None = None,
                 token_ids: torch.Tensor | None = None) -> DraftTree:
    """Top-`budget` prefixes of the factorised score. logprobs: [depth, vocab] (draft T = 1), or
    [depth, N] over the tokens `token_ids` (a draft vocabulary).

    `stop(n_popped_so_far, score_of_candidate)` may end the build early (CaDDTree's rule)."""
    tokens, parents, depths, scores = [root_token], [-1], [0], [0.0]
    for tok, parent, score, depth in ddtree_pops(logprobs, budget, token_ids):
        if stop is not None and stop(len(tokens) - 1, score):
            break
        tokens.append(tok)
        parents.append(parent)
        depths.append(depth)
        scores.append(score)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths),
                     torch.tensor(scores, dtype=torch.float32))
