"""Domino: a causal correction head on the DFlash backbone.

A GRU (no bias) summarises the tokens drafted so far (root included) into a state S; a low-rank
head adds Delta L = W2 SiLU(W1 [H_d; S]) to the backbone's base logits. The correction lives in
logit space, so the LM head is never re-run per token, and W2 rows can be taken for a candidate
subset only (what DominoTree's top-M restriction uses).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

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

    def root_state(self, root: int, target) -> torch.Tensor:
        emb = target.embed(torch.tensor([root]))
        return self.head.gru_step(self.head.zero_state(1), emb)

    @torch.inference_mode()
    def chain(self, draft: DraftOutput, root: int, target, depth: int, topm: int = 64) -> tuple[list[int], list[float]]:
        """The Domino chain: tokens argmax(L_base + Delta L) over the whole vocabulary, depths 1..depth.

        Only the argmax is taken over the vocabulary (one W2 product per depth); the log-probs
        that label the chain's nodes are normalised over the top-`topm` base candidates."""
        w2 = self.head.embed_proj[2].weight
        base_all = draft.base_logits[:depth]
        cand_all = torch.topk(base_all, min(topm, base_all.shape[-1]), dim=-1).indices
        state = self.root_state(root, target)
        tokens, logps = [], []
        for d in range(1, depth + 1):
            base = base_all[d - 1]
            if d <= self.prefix_len:
                tok = int(torch.argmax(base))
                lp_tok = float(torch.log_softmax(base, -1)[tok])
            else:
                corr = F.linear(self.head.low_rank(draft.hidden[d - 1][None], state)[0], w2)
                full = base + corr.float()
                tok = int(torch.argmax(full))
                cand = cand_all[d - 1]
                lp_tok = float(full[tok] - torch.logsumexp(full[cand], -1)) if bool((cand == tok).any()) else float("-inf")
            tokens.append(tok)
            logps.append(lp_tok)
            if d < depth:
                state = self.head.gru_step(state, target.embed(torch.tensor([tok])))
        return tokens, logps
