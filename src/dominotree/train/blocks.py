"""Training blocks: random anchors in target-written responses, each block = [anchor, MASK...],
seeing only the clean context before its anchor (as at inference, where the root has no
target features yet) and its own block (bidirectional)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BlockBatch:
    ctx_feats: torch.Tensor    # [B, S, k*h] bf16 target features
    ctx_pos: torch.Tensor      # [B, S]
    block_ids: torch.Tensor    # [B, N*b] anchor token then MASK
    block_pos: torch.Tensor    # [B, N*b]
    mask: torch.Tensor         # [B, 1, N*b, S + N*b] bool (True = attend)
    labels: torch.Tensor       # [B, N, D] token at depth d (-100 = none)
    truth: torch.Tensor        # [B, N, b] ground-truth tokens at anchor + 0..b-1 (GRU teacher forcing)
    soft_ids: torch.Tensor | None = None    # [B, N, D, k] the target's top-k for each label (-1 = none)
    soft_logp: torch.Tensor | None = None   # [B, N, D, k] their log-probs


def make_batch(seqs, block_size: int, num_anchors: int, num_depths: int, mask_token_id: int,
               generator: torch.Generator, topk=None) -> BlockBatch:
    """seqs: list of (tokens [L], feats [L, k*h], prompt_len); topk: optional list of (ids [L, k],
    log-probs [L, k]), the target's prediction for the token after each position (soft labels)."""
    B, b, N = len(seqs), block_size, num_anchors
    S = max(len(t) for t, _, _ in seqs)
    dim = seqs[0][1].shape[-1]
    ctx = torch.zeros(B, S, dim, dtype=torch.bfloat16)
    block_ids = torch.full((B, N * b), mask_token_id, dtype=torch.long)
    block_pos = torch.zeros(B, N * b, dtype=torch.long)
    mask = torch.zeros(B, 1, N * b, S + N * b, dtype=torch.bool)
    labels = torch.full((B, N, num_depths), -100, dtype=torch.long)
    truth = torch.zeros(B, N, b, dtype=torch.long)
    soft_ids = soft_logp = None
    if topk is not None:
        k = topk[0][0].shape[-1]
        soft_ids = torch.full((B, N, num_depths, k), -1, dtype=torch.long)
        soft_logp = torch.full((B, N, num_depths, k), float("-inf"))
    offsets = torch.arange(b)
    for i, (toks, feats, plen) in enumerate(seqs):
        L = len(toks)
        ctx[i, :L] = feats
        # anchors: response positions with at least one label after them
        lo, hi = plen, L - 1
        choices = torch.arange(lo, hi)
        pick = choices[torch.randperm(len(choices), generator=generator)[:N]].sort().values
        for n, a in enumerate(pick.tolist()):
            sl = slice(n * b, (n + 1) * b)
            block_ids[i, n * b] = toks[a]
            block_pos[i, sl] = a + offsets
            mask[i, 0, sl, :a] = True                               # clean context strictly before the anchor
            mask[i, 0, sl, S + n * b:S + (n + 1) * b] = True          # own block, bidirectional
            d = torch.arange(1, num_depths + 1)
            ok = a + d < L
            labels[i, n, :ok.sum()] = toks[a + d[ok]]
            if topk is not None:     # the label at a + d is predicted at position a + d - 1
                soft_ids[i, n, :ok.sum()] = topk[i][0][a + d[ok] - 1]
                soft_logp[i, n, :ok.sum()] = topk[i][1][a + d[ok] - 1]
            t_ok = a + offsets < L
            truth[i, n, :t_ok.sum()] = toks[a + offsets[t_ok]]
        for n in range(len(pick), N):                                 # unused slots: attend to themselves only
            mask[i, 0, n * b:(n + 1) * b, S + n * b:S + (n + 1) * b] = True
    return BlockBatch(ctx, torch.arange(S).expand(B, S), block_ids, block_pos, mask, labels, truth,
                      soft_ids, soft_logp)


def depth_weights(num_depths: int, gamma: float) -> torch.Tensor:
    """exp(-(d - 1) / gamma) for depth d = 1..D (DFlash's per-offset decay)."""
    return torch.exp(-(torch.arange(1, num_depths + 1).float() - 1) / gamma)


def sample_anchors(lens: torch.Tensor, prompt_lens: torch.Tensor, num_anchors: int,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to num_anchors distinct response positions per row (a with prompt_len <= a < len - 1),
    sorted, drawn uniformly: [B, N] positions and [B, N] validity (rows with fewer choices fill
    the rest with invalid slots). Tensors stay on lens' device (make_batch's per-row draws, batched)."""
    B, S = len(lens), int(lens.max())
    pos = torch.arange(S, device=lens.device)
    ok = (pos[None] >= prompt_lens[:, None]) & (pos[None] < lens[:, None] - 1)
    score = torch.rand(B, S, generator=generator, device=lens.device)     # a generator on lens' device
    score = torch.where(ok, score, torch.full_like(score, -1.0))
    n = min(num_anchors, S)
    top = score.topk(n, -1)
    valid = top.values >= 0
    anchors = torch.where(valid, top.indices, torch.full_like(top.indices, S))   # invalid slots sort last
    anchors, order = anchors.sort(-1)
    valid = valid.gather(1, order)
    anchors = torch.where(valid, anchors, torch.zeros_like(anchors))
    if n < num_anchors:
        pad = torch.zeros(B, num_anchors - n, dtype=anchors.dtype, device=anchors.device)
        anchors, valid = torch.cat([anchors, pad], 1), torch.cat([valid, pad.bool()], 1)
    return anchors, valid


def blocks_from_anchors(tokens: torch.Tensor, lens: torch.Tensor, feats: torch.Tensor, anchors: torch.Tensor,
                        valid: torch.Tensor, block_size: int, num_depths: int, mask_token_id: int) -> BlockBatch:
    """make_batch's blocks for given anchors, built with tensor ops on tokens' device:
    tokens [B, S] (right-padded), lens [B], feats [B, S, k*h], anchors / valid [B, N]."""
    B, S = tokens.shape
    N, b, dev = anchors.shape[1], block_size, tokens.device
    offsets = torch.arange(b, device=dev)
    block_ids = torch.full((B, N, b), mask_token_id, dtype=torch.long, device=dev)
    block_ids[:, :, 0] = torch.where(valid, tokens.gather(1, anchors), block_ids[:, :, 0])
    block_pos = torch.where(valid[..., None], anchors[..., None] + offsets, torch.zeros((), dtype=torch.long, device=dev))
    cols = torch.arange(S, device=dev)
    ctx_ok = (cols.view(1, 1, 1, S) < anchors.view(B, N, 1, 1)) & valid.view(B, N, 1, 1)      # [B, N, 1, S]
    own = torch.eye(N, dtype=torch.bool, device=dev).view(1, N, 1, N, 1)                       # block n sees block n
    mask = torch.cat([ctx_ok.expand(B, N, b, S).reshape(B, N * b, S),
                      own.expand(1, N, b, N, b).reshape(1, N * b, N * b).expand(B, -1, -1)], -1)[:, None]
    depth = torch.arange(1, num_depths + 1, device=dev)
    at = anchors[..., None] + depth                                                          # [B, N, D]
    labels = tokens.gather(1, at.clamp_max(S - 1).view(B, -1)).view(B, N, num_depths)
    labels = torch.where((at < lens.view(B, 1, 1)) & valid[..., None], labels, torch.full_like(labels, -100))
    tat = anchors[..., None] + offsets
    truth = tokens.gather(1, tat.clamp_max(S - 1).view(B, -1)).view(B, N, b)
    truth = torch.where((tat < lens.view(B, 1, 1)) & valid[..., None], truth, torch.zeros_like(truth))
    ctx_pos = torch.arange(S, device=dev).expand(B, S)
    return BlockBatch(feats, ctx_pos, block_ids.view(B, N * b), block_pos.view(B, N * b), mask, labels, truth)
