"""DominoTree: conditional best-first trees (reference builder).

A node's children are scored with Domino's path-conditional logits: the GRU state has consumed
the root and the node's own path, and L = L_base_d + W2 SiLU(W1 [H_d; S_path]). H_d (the
expensive backbone output) is shared by every path; only the GRU step and the low-rank head are
per node. Per depth only the top-M candidates of the base logits are corrected (computed once
per round); the node_topk best become children, all pushed at once (ties: insertion order).

This is the readable reference; trees/fast.py builds the identical tree with batched work.
"""
from __future__ import annotations

import heapq
import math
from typing import Callable

import torch

from ..draft_vocab import widen
from .topk import topk_rows
from .tree import DraftTree


def _embedder(embed):
    if callable(embed) and not isinstance(embed, torch.Tensor):
        return lambda ids: embed(ids).float()
    return lambda ids: embed[ids].float()


def depth_candidates(base_logits: torch.Tensor, corr_topm: int | None,
                     vocab_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Top-M base-logit candidates per depth: (token ids [D, M], their base logits [D, M]), best
    first (None: the whole vocabulary). `vocab_ids`: the token of each column (compact rows)."""
    if corr_topm is None or corr_topm >= base_logits.shape[-1]:
        return None
    values, cols = topk_rows(base_logits, corr_topm)
    return (cols if vocab_ids is None else vocab_ids[cols]), values


def marginal_children(base_row: torch.Tensor, node_topk: int,
                      cands_row: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[list[int], list[float]]:
    """(tokens, log-probs) of the node_topk best children from base logits alone (prefix depths).

    `cands_row`, the row's top-M (ids, logits) in descending order (M >= node_topk), saves a
    second pass over the row: the best children are its first node_topk. Without it the row's
    columns are the token ids."""
    if cands_row is not None and len(cands_row[0]) >= node_topk:
        ids, logits = cands_row[0][:node_topk], cands_row[1][:node_topk]
        return ids.tolist(), (logits - torch.logsumexp(base_row, -1)).tolist()
    values, ids = topk_rows(torch.log_softmax(base_row, -1), node_topk)
    return ids.tolist(), values.tolist()


def vocabulary_wide(base_logits: torch.Tensor, vocab_ids: torch.Tensor | None, vocab_size: int,
                    corr_topm: int | None, normalization: str, conditioning: str):
    """(base_logits, vocab_ids) as a builder needs them: compact rows over a draft vocabulary
    suffice for the published setting (top-M candidates, "topm" normalisation, path
    conditioning); the settings that score the whole vocabulary get [D, V] rows (-inf off it)."""
    whole = corr_topm is None or corr_topm >= base_logits.shape[-1]
    if vocab_ids is None or not (whole or normalization == "exact" or conditioning == "greedy"):
        return base_logits, vocab_ids
    return widen(base_logits, vocab_ids, vocab_size), None


def greedy_chain_states(base_logits, hidden, head, emb, root_state, prefix_len):
    """States along the greedy corrected chain: the "correction once per depth" ladder rung."""
    states, state = [], root_state
    for d in range(1, base_logits.shape[0] + 1):
        states.append(state)
        logits = base_logits[d - 1]
        if d > prefix_len:
            logits = logits + head.correction(hidden[d - 1][None], state)[0].float()
        state = head.gru_step(state, emb(torch.argmax(logits)[None]))
    return states


def build_dominotree(base_logits: torch.Tensor, hidden: torch.Tensor, head, embed, root_token: int,
                     budget: int, node_topk: int = 8, corr_topm: int | None = 64,
                     normalization: str = "topm", prefix_len: int = 1, max_depth: int | None = None,
                     stop: Callable[[int, float], bool] | None = None,
                     conditioning: str = "path", vocab_ids: torch.Tensor | None = None) -> DraftTree:
    """Reference builder. base_logits [D, V], or [D, N] over the token ids `vocab_ids` (a draft
    vocabulary), hidden [D, h] (depth d at row d - 1).

    normalization: "topm" = log-softmax over the M corrected candidates (published);
    "exact" = over the whole corrected vocabulary. `stop(n, score)` ends the build before a
    candidate is accepted (CondAdaptive)."""
    if normalization not in ("topm", "exact"):
        raise ValueError(f"normalization must be 'topm' or 'exact', got {normalization!r}")
    base_logits, hidden = base_logits.float(), hidden.float()
    base_logits, vocab_ids = vocabulary_wide(base_logits, vocab_ids, head.embed_proj[2].weight.shape[0],
                                             corr_topm, normalization, conditioning)
    depth_limit = base_logits.shape[0] if max_depth is None else min(max_depth, base_logits.shape[0])
    emb = _embedder(embed)
    cands = depth_candidates(base_logits, corr_topm, vocab_ids)
    root_state = head.gru_step(head.zero_state(1, dtype=torch.float32), emb(torch.tensor([root_token])))
    fixed = None
    if conditioning == "greedy":
        fixed = greedy_chain_states(base_logits, hidden, head, emb, root_state, prefix_len)

    def children(state, d):
        """(tokens, log-probs) of the node_topk best children at depth d for a parent state."""
        base = base_logits[d - 1]
        if d <= prefix_len:
            return marginal_children(base, node_topk, None if cands is None else (cands[0][d - 1], cands[1][d - 1]))
        if fixed is not None:
            state = fixed[d - 1]
        if cands is None:
            lp = torch.log_softmax(base + head.correction(hidden[d - 1][None], state)[0].float(), -1)
            top = torch.topk(lp, min(node_topk, lp.numel()))
            return top.indices.tolist(), top.values.tolist()
        c = cands[0][d - 1]
        corrected = cands[1][d - 1] + head.correction(hidden[d - 1][None], state, c)[0].float()
        if normalization == "topm":
            lp = torch.log_softmax(corrected, -1)
        else:
            full = base + head.correction(hidden[d - 1][None], state)[0].float()
            lp = corrected - torch.logsumexp(full, -1)
        top = torch.topk(lp, min(node_topk, lp.numel()))
        return c[top.indices].tolist(), top.values.tolist()

    tokens, parents, depths, scores, states = [root_token], [-1], [0], [0.0], [root_state]
    heap, counter = [], 0
    if depth_limit >= 1:
        for tok, lp in zip(*children(root_state, 1)):
            heapq.heappush(heap, (-lp, counter, tok, 1, 0))
            counter += 1
    while heap and len(tokens) - 1 < budget:
        neg, _, tok, depth, parent = heapq.heappop(heap)
        if stop is not None and stop(len(tokens) - 1, -neg):
            break
        idx = len(tokens)
        tokens.append(tok)
        parents.append(parent)
        depths.append(depth)
        scores.append(-neg)
        state = head.gru_step(states[parent], emb(torch.tensor([tok])))
        states.append(state)
        if depth < depth_limit:
            for ctok, lp in zip(*children(state, depth + 1)):
                heapq.heappush(heap, (neg - lp, counter, ctok, depth + 1, idx))
                counter += 1
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths),
                     torch.tensor(scores, dtype=torch.float32))


class ThroughputStop:
    """CaDDTree's throughput rule as a stop predicate: stop before the first candidate whose
    acceptance would not raise theta(n) = (1 + phi(n)) / (C_draft + C_verify(n, ctx))."""

    def __init__(self, cost_model, context_len: int):
        self.cost_model, self.context_len = cost_model, context_len
        self.phi = 0.0
        self.theta = 1.0 / self.round_cost(0)

    def round_cost(self, n: int) -> float:
        return self.cost_model.c_draft + self.cost_model.c_verify(n, self.context_len)

    def costs(self, max_nodes: int) -> list[float]:
        """round_cost(n) for n = 0 .. max_nodes (the table the native builder applies the rule with)."""
        return [self.round_cost(n) for n in range(max_nodes + 1)]

    def __call__(self, n: int, score: float) -> bool:
        delta = math.exp(score)
        theta = (1.0 + self.phi + delta) / self.round_cost(n + 1)
        if theta <= self.theta:
            return True
        self.phi += delta
        self.theta = theta
        return False


def path_probability_stop(cost_model, context_len: int) -> ThroughputStop:
    """A fresh stop predicate for one tree (it keeps the tree's running phi and theta)."""
    return ThroughputStop(cost_model, context_len)
