"""Fast DominoTree builder: the same heap, the same pops, far fewer tensor calls.

A node's GRU step and its children's scores depend only on its own path, so they can be
computed before it is popped. When a popped node has no cached expansion, the builder expands
it together with the best entries still on the heap (the nodes most likely to be popped next)
in one batched call. Per round it also hoists what every node shares: the top-M candidates,
their base logits and W2 rows, and W1's hidden-state half applied to H_d.
The pop sequence, tokens and parents are those of trees/dominotree.build_dominotree.
"""
from __future__ import annotations

import heapq
from typing import Callable

import torch
import torch.nn.functional as F

from ..drafters.domino import gru_cell
from .dominotree import _embedder, depth_candidates, greedy_chain_states, marginal_children
from .tree import DraftTree


class HeadWeights:
    """float32 views of a DominoHead's weights, split for the hoisted computation."""

    def __init__(self, head):
        h = head.config.hidden_size
        self.w_ih = head.prefix_gru.weight_ih_l0.detach().float()
        self.w_hh = head.prefix_gru.weight_hh_l0.detach().float()
        w1 = head.embed_proj[0].weight.detach().float()
        self.w1_h, self.w1_s = w1[:, :h], w1[:, h:]
        self.w2 = head.embed_proj[2].weight.detach().float()

    def gru(self, state, x):
        return gru_cell(state, x, self.w_ih, self.w_hh)


def build_dominotree_fast(base_logits: torch.Tensor, hidden: torch.Tensor, head, embed, root_token: int,
                          budget: int, node_topk: int = 8, corr_topm: int | None = 64,
                          normalization: str = "topm", prefix_len: int = 1, max_depth: int | None = None,
                          stop: Callable[[int, float], bool] | None = None, conditioning: str = "path",
                          weights: HeadWeights | None = None, lookahead: int = 32) -> DraftTree:
    base_logits, hidden = base_logits.float(), hidden.float()
    D = base_logits.shape[0] if max_depth is None else min(max_depth, base_logits.shape[0])
    W = weights or HeadWeights(head)
    emb = _embedder(embed)
    k = min(node_topk, base_logits.shape[-1] if corr_topm is None else min(corr_topm, base_logits.shape[-1]))
    cands = depth_candidates(base_logits, corr_topm)
    # Hoisted per round: W1_h H_d, candidate base logits and W2 rows, prefix-depth children.
    zh = F.linear(hidden[:D], W.w1_h) if D else None
    if cands is not None:
        M = cands.shape[1]
        base_c = torch.gather(base_logits, 1, cands)[:D]
        w2_c = W.w2[cands[:D].reshape(-1)]                    # [D * M, r]: every depth's candidate rows
    prefix_kids = {d: marginal_children(base_logits[d - 1], node_topk, None if cands is None else cands[d - 1])
                   for d in range(1, min(prefix_len, D) + 1)}
    root_state = W.gru(torch.zeros(1, W.w_hh.shape[1]), emb(torch.tensor([root_token])))
    fixed = None
    if conditioning == "greedy":
        fixed = torch.cat(greedy_chain_states(base_logits, hidden, head, emb, root_state, prefix_len, cands))

    def expand(states: torch.Tensor, child_depths: list[int]):
        """Children (tokens, log-probs) for a batch of parent states at the given child depths."""
        out = [None] * len(child_depths)
        rows = [i for i, d in enumerate(child_depths) if d > prefix_len]
        for i, d in enumerate(child_depths):
            if d <= prefix_len:
                out[i] = prefix_kids[d]
        if not rows:
            return out
        di = torch.tensor([child_depths[i] - 1 for i in rows])
        s = fixed[di] if fixed is not None else states[rows]
        z = F.silu(zh[di] + F.linear(s, W.w1_s))              # [n, r]
        if cands is None:
            lp = torch.log_softmax(base_logits[di] + F.linear(z, W.w2), -1)
            top = torch.topk(lp, k, dim=-1)
            ids, vals = top.indices, top.values
        else:
            # One product against all depths' candidates, then each row's own depth: cheaper
            # here than gathering [n, M, r] W2 rows per expansion.
            every = F.linear(z, w2_c).view(len(rows), D, M)
            corrected = base_c[di] + every[torch.arange(len(rows)), di]
            if normalization == "topm":
                lp = torch.log_softmax(corrected, -1)
            else:
                lp = corrected - torch.logsumexp(base_logits[di] + F.linear(z, W.w2), -1, keepdim=True)
            top = torch.topk(lp, k, dim=-1)
            ids, vals = torch.gather(cands[di], 1, top.indices), top.values
        for j, (t, v) in enumerate(zip(ids.tolist(), vals.tolist())):
            out[rows[j]] = (t, v)
        return out

    tokens, parents, depths, scores = [root_token], [-1], [0], [0.0]
    states: list[torch.Tensor | None] = [root_state[0]]
    cache: dict[int, tuple] = {}           # heap entry id -> (state, children)
    heap, counter = [], 0
    if D >= 1:
        for tok, lp in zip(*expand(root_state, [1])[0]):
            heapq.heappush(heap, (-lp, counter, tok, 1, 0))
            counter += 1
    while heap and len(tokens) - 1 < budget:
        entry = heapq.heappop(heap)
        neg, eid, tok, depth, parent = entry
        if stop is not None and stop(len(tokens) - 1, -neg):
            break
        if eid not in cache:
            room = budget - (len(tokens) - 1)
            batch = [entry] + heapq.nsmallest(min(lookahead, room) - 1, heap) if room > 1 else [entry]
            batch = [e for e in batch if e[1] not in cache]
            par = torch.stack([states[e[4]] for e in batch])
            new_states = W.gru(par, emb(torch.tensor([e[2] for e in batch])))
            grow = [i for i, e in enumerate(batch) if e[3] < D]     # nodes at the depth limit have no children
            kids = dict(zip(grow, expand(new_states[grow], [batch[i][3] + 1 for i in grow]))) if grow else {}
            for i, (e, s) in enumerate(zip(batch, new_states)):
                cache[e[1]] = (s, kids.get(i))
        state, kids = cache.pop(eid)
        idx = len(tokens)
        tokens.append(tok)
        parents.append(parent)
        depths.append(depth)
        scores.append(-neg)
        states.append(state)
        if kids is not None:
            for ctok, lp in zip(*kids):
                heapq.heappush(heap, (neg - lp, counter, ctok, depth + 1, idx))
                counter += 1
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths),
                     torch.tensor(scores, dtype=torch.float32))
