"""The drafter loss: DFlash's weighted CE on base logits, plus Domino's head.

Domino: the GRU is teacher-forced on ground-truth tokens (state for depth d has consumed the
anchor and the true tokens at depths 1..d-1); loss = lam * CE(base) + (1 - lam) * CE(final),
lam annealed linearly 1 -> 0 (base-anchored curriculum). Ablation switches: ttt (the GRU is fed
the head's own argmax drafts), no curriculum (lam = 0)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .dflash import accept_len, soft_ce, weighted_ce


def label_loss(logits, batch, weights, tc):
    """CE on the data tokens, mixed with the target's top-k when distilling; also the argmax hits.
    Distilling shares one log-softmax between the two terms (it is the costly part)."""
    if not (tc.distill > 0 and batch.soft_ids is not None):
        return weighted_ce(logits, batch.labels, weights)
    logq = torch.log_softmax(logits.float(), -1)
    hard, hits = weighted_ce(logits, batch.labels, weights, logq)
    soft = soft_ce(logq, batch.soft_ids, batch.soft_logp, batch.labels, weights)
    return (1 - tc.distill) * hard + tc.distill * soft, hits


def domino_loss(drafter, hid, batch, embed_w, head_w, vocab_ids, weights, cfg, lam, tc):
    """head_w holds the LM-head rows of vocab_ids (the training vocabulary); labels are columns of it."""
    base = F.linear(hid, head_w)                              # [B, N, D, V']
    loss_base, hits_base = label_loss(base, batch, weights, tc)
    metrics = {"loss_base": float(loss_base.detach()), "accept_len_base": accept_len(hits_base)}
    if not tc.head:
        return loss_base, metrics
    head = drafter.head
    prefix = cfg.pure_draft_prefix_len
    if tc.ttt:
        final = ttt_logits(head, hid, base, batch, embed_w, vocab_ids, prefix)
    else:
        final = teacher_forced_logits(head, hid, base, batch.truth, embed_w, prefix, vocab_ids)
    loss_final, hits_final = label_loss(final, batch, weights, tc)
    metrics.update(loss_final=float(loss_final.detach()), accept_len_final=accept_len(hits_final))
    return lam * loss_base + (1 - lam) * loss_final, metrics


def teacher_forced_logits(head, hid, base, truth, embed_w, prefix, vocab_ids=None):
    """The head's final logits [B, N, D, V'] with its GRU teacher-forced on the ground truth
    (truth [B, N, b]: anchor, then the true depths): base plus the correction past the prefix."""
    B, N, D, _ = hid.shape
    states = head.teacher_forced_states(embed_w[truth[:, :, :D].reshape(B * N, D)].float()).view(B, N, D, -1)
    corr = head.correction(hid, states.to(hid.dtype), vocab_ids)
    keep = (torch.arange(1, D + 1, device=hid.device) > prefix).view(1, 1, D, 1)
    return base + corr * keep


def ttt_logits(head, hid, base, batch, embed_w, vocab_ids, prefix):
    """Training-time test: the GRU advances on its own (detached) argmax drafts."""
    B, N, D, _ = hid.shape
    state = head.zero_state(B * N, dtype=torch.float32)
    state = head.gru_step(state, embed_w[batch.truth[:, :, 0].reshape(-1)].float())   # the anchor (root)
    outs = []
    for d in range(1, D + 1):
        logits = base[:, :, d - 1]
        if d > prefix:
            logits = logits + head.correction(hid[:, :, d - 1], state.view(B, N, -1).to(hid.dtype), vocab_ids)
        outs.append(logits)
        tok = vocab_ids[logits.detach().argmax(-1).reshape(-1)]
        state = head.gru_step(state, embed_w[tok].float())
    return torch.stack(outs, 2)
