"""Domino: a causal correction head on the DFlash backbone.

A GRU (no bias) summarises the tokens drafted so far (root included) into a state S; a low-rank
head adds Delta L = W2 SiLU(W1 [H_d; S]) to the backbone's base logits. The correction lives in
logit space, so the LM head is never re-run per token, and W2 rows can be taken for a candidate
subset only (what DominoTree's top-M restriction uses).
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..trees.topk import topk_rows
from .dflash import DFlashBackbone, DFlashDrafter, DraftOutput, DrafterConfig


def gru_cell(state: torch.Tensor, x: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor) -> torch.Tensor:
    """One bias-free GRU step (gate order r, z, n as torch.nn.GRU)."""
    i_r, i_z, i_n = F.linear(x, w_ih).chunk(3, -1)
    h_r, h_z, h_n = F.linear(state, w_hh).chunk(3, -1)
    r, z = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
    return (1 - z) * torch.tanh(i_n + r * h_n) + z * state


class DominoHead(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.config = c
        h, g, r = c.hidden_size, c.gru_hidden_dim, c.emb_dim
        self.prefix_gru = nn.GRU(h, g, num_layers=1, bias=False, batch_first=True)
        self.embed_proj = nn.Sequential(nn.Linear(h + g, r, bias=False), nn.SiLU(), nn.Linear(r, c.vocab_size, bias=False))

    def zero_state(self, n: int = 1, dtype=None, device=None) -> torch.Tensor:
        w = self.prefix_gru.weight_hh_l0
        return torch.zeros(n, self.config.gru_hidden_dim, dtype=dtype or w.dtype, device=device or w.device)

    def gru_step(self, state: torch.Tensor, token_emb: torch.Tensor) -> torch.Tensor:
        """One GRU step for a batch: state [n, G], token_emb [n, h] -> [n, G] (gates r, z, n as torch)."""
        return gru_cell(state, token_emb.to(state.dtype), self.prefix_gru.weight_ih_l0, self.prefix_gru.weight_hh_l0)

    def teacher_forced_states(self, token_embs: torch.Tensor) -> torch.Tensor:
        """GRU outputs over ground-truth embeddings [B, T, h] from a zero state: [B, T, G]."""
        out, _ = self.prefix_gru(token_embs)
        return out

    def low_rank(self, hidden: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """SiLU(W1 [H; S]) -> [n, r]."""
        return F.silu(self.embed_proj[0](torch.cat([hidden.to(state.dtype), state], -1)))

    def correction(self, hidden: torch.Tensor, state: torch.Tensor, candidates: torch.Tensor | None = None) -> torch.Tensor:
        """Delta L for hidden [n, h] and state [n, G]: [n, V], or [n, M] for candidate ids [M] / [n, M]."""
        z = self.low_rank(hidden, state)
        w2 = self.embed_proj[2].weight
        if candidates is None:
            return F.linear(z, w2)
        if candidates.dim() == 1:
            return F.linear(z, w2[candidates])
        return torch.einsum("nr,nmr->nm", z, w2[candidates])


class W2Bound:
    """W2 split along its top-k right singular directions, for bounding W2 z without reading W2.

    W2_v z = (U_v . P^T z) + (R_v . z) with U = W2 P and R = W2 - U P^T, so
    W2_v z <= U_v . P^T z + |R_v| |z - P P^T z|. The head's W2 concentrates most of its energy in a
    few directions, so the bound is tight where the plain |W2_v| |z| is not."""

    def __init__(self, w2: torch.Tensor, k: int = 16):
        self.w2 = w2.detach().float()
        k = min(k, min(self.w2.shape))
        self.p = torch.linalg.svd(self.w2, full_matrices=False).Vh[:k].T.contiguous()   # [r, k]
        self.u = (self.w2 @ self.p).contiguous()                                        # [V, k]
        self.res_norms = (self.w2 - self.u @ self.p.T).norm(dim=-1)                      # [V]

    def upper(self, z: torch.Tensor) -> torch.Tensor:
        zp = self.p.T @ z
        return self.u @ zp + self.res_norms * (z - self.p @ zp).norm()

    def columns(self, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(W2, U, |R_v|) for the tokens `ids` (all tokens: None), contiguous: what the native chain
        scans. Kept for the last ids asked (a draft vocabulary's, across rounds)."""
        kept = getattr(self, "_columns", None)
        if kept is None or kept[0] is not ids:
            pick = (lambda t: t) if ids is None else (lambda t: t[ids])
            self._columns = (ids, tuple(pick(t).contiguous() for t in (self.w2, self.u, self.res_norms)))
        return self._columns[1]


def corrected_argmax(base: torch.Tensor, z: torch.Tensor, bound: W2Bound,
                     cand: torch.Tensor) -> tuple[int, torch.Tensor, int]:
    """argmax over the whole vocabulary of base + W2 z, without the full W2 product.

    Only the tokens whose upper bound (`W2Bound`) reaches the best corrected candidate can win,
    so only they are scored exactly. Returns (token, corrected logits of `cand`, tokens scored).
    Ties go to the lowest token id, as torch.argmax over the full vector does."""
    w2 = bound.w2
    corr_c = base[cand] + w2[cand] @ z
    best = corr_c.max()
    reach = base + bound.upper(z) >= best - 1e-4 * (1 + best.abs())   # slack for rounding
    reach[cand] = False
    rest = reach.nonzero().flatten()
    ids = torch.cat([cand, rest])
    vals = torch.cat([corr_c, base[rest] + w2[rest] @ z])
    tok = int(ids[vals == vals.max()].min())
    return tok, corr_c, len(ids)


class DominoDrafter(DFlashDrafter):
    """Backbone + head. Depth d uses the correction iff d > pure_draft_prefix_len; the state used
    at depth d has consumed the root and the tokens at depths 1..d-1."""

    def __init__(self, backbone: DFlashBackbone, head: DominoHead, name: str = "domino"):
        super().__init__(backbone, name)
        self.head = head.eval()

    def to(self, dtype=None, device=None) -> "DominoDrafter":
        super().to(dtype, device)
        self.head.to(device=device, dtype=dtype)
        return self

    @property
    def prefix_len(self) -> int:
        return self.config.pure_draft_prefix_len

    def _float_cache_entry(self) -> dict:
        """float32 head (and, lazily, W2's bound) for the current weights; remade when the head's
        weights change (moved, cast or updated in place)."""
        key = tuple((w.data_ptr(), w.dtype, w._version) for w in self.head.parameters())
        if getattr(self, "_float_cache", {}).get("key") != key:
            with torch.inference_mode(False):   # usable outside inference mode too (the builders)
                head = copy.deepcopy(self.head).float().requires_grad_(False)
            self._float_cache = {"key": key, "head": head, "bound": None}
        return self._float_cache

    def float_head(self) -> DominoHead:
        """A float32 copy of the head, shared by the chain and the tree builders (they score in
        float32: the per-node matrix-vector products are ~10x slower in bf16 on CPU)."""
        return self._float_cache_entry()["head"]

    def tree_weights(self):
        """The fast tree builder's view of the float head (trees/fast.HeadWeights), kept with it so
        that its table of GRU input rows lasts across requests."""
        entry = self._float_cache_entry()
        if entry.get("tree_weights") is None:
            from ..trees.fast import HeadWeights
            entry["tree_weights"] = HeadWeights(entry["head"])
        return entry["tree_weights"]

    def w2_bound(self) -> W2Bound:
        """The chain's bound on W2 z (`corrected_argmax`), built on the float head's W2."""
        entry = self._float_cache_entry()
        if entry["bound"] is None:
            with torch.inference_mode(False):
                entry["bound"] = W2Bound(entry["head"].embed_proj[2].weight)
        return entry["bound"]

    def root_state(self, root: int, target) -> torch.Tensor:
        """The float head's GRU state after the root token."""
        head = self.float_head()
        return head.gru_step(head.zero_state(1), target.embed(torch.tensor([root])))

    @torch.inference_mode()
    def chain(self, draft: DraftOutput, root: int, target, depth: int, topm: int = 64,
              pruned: bool = True) -> tuple[list[int], list[float]]:
        """The Domino chain: tokens argmax(L_base + Delta L) over the whole vocabulary, depths 1..depth.

        The argmax is exact over the vocabulary; `pruned` scores only the tokens that can win
        (`corrected_argmax`), `pruned=False` is the reference full W2 product per depth. The
        log-probs that label the chain's nodes are normalised over the top-`topm` base candidates.
        The correction is computed in float32, as the tree builders do."""
        head, bound = self.float_head(), self.w2_bound()
        w2, hidden = bound.w2, draft.hidden[:depth].float()
        base_all = draft.base_logits[:depth].float()
        cand_all = topk_rows(base_all, topm)[1]
        state = self.root_state(root, target)
        tokens, logps = [], []
        for d in range(1, depth + 1):
            base = base_all[d - 1]
            if d <= self.prefix_len:
                tok = int(torch.argmax(base))
                lp_tok = float(torch.log_softmax(base, -1)[tok])
            else:
                z = head.low_rank(hidden[d - 1][None], state)[0]
                cand = cand_all[d - 1]
                if pruned:
                    tok, corr_c, _ = corrected_argmax(base, z, bound, cand)
                else:
                    full = base + F.linear(z, w2)
                    tok, corr_c = int(torch.argmax(full)), full[cand]
                hit = (cand == tok).nonzero()
                lp_tok = float(corr_c[hit[0, 0]] - torch.logsumexp(corr_c, -1)) if len(hit) else float("-inf")
            tokens.append(tok)
            logps.append(lp_tok)
            if d < depth:
                state = head.gru_step(state, target.embed(torch.tensor([tok])))
        return tokens, logps
