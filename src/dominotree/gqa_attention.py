"""Grouped-query attention for short query blocks, without copying the KV cache per head.

A GQA model (SmolLM2-135M: 9 query heads share 3 key/value heads) attends with transformers'
`sdpa` function, which on CPU either asks SDPA for `enable_gqa` (a one-token step: ~5x slower
here than the packed call below) or, with a mask (every tree verify), copies each key/value
head `groups` times per layer and step (`repeat_kv`), a copy that grows with the context.
This function instead folds each head group's queries into one query block of its key/value
head, [B, H, n, D] -> [B, H_kv, groups * n, D] (the mask repeated alongside), and runs one SDPA
call on the cache as it is. Each query row meets the same keys; only the kernel's blocking of the
rows changes, so the outputs equal `sdpa`'s up to rounding (on the embedded model a decoding step
had 2 of 30 layers one bf16 step apart; greedy outputs then part from the stock path's only at
near-ties, as the benchmark's equality check reports). Measured on a 2-core EPYC, interleaved per
prompt: plain decoding 1.05-1.06x faster, DominoTree 1.03-1.05x; a one-token step at 300-600 tokens
of context 8-17% (docs/RESULTS.md, "Packed GQA attention").

Masked blocks (tree verifies) and one-token steps run on `tree_attention.py`'s kernel where the
CPU has one for the dtype (so a verify's row and a step of the same token give the same bits).
Prefill without a mask (SDPA's `is_causal` path), dropout, position biases, per-head masks and
models without grouped heads go to transformers' own `sdpa` function unchanged.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch.nn.functional as F

from . import tree_attention

try:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
    AVAILABLE = True
except ImportError:   # a transformers without these extension points: models keep their attention
    AVAILABLE = False

NAME = "dominotree_gqa"


def grouped_mask(mask, groups: int):
    """mask [b, 1, n, L] repeated for the `groups` query heads folded into each query block:
    [b, 1, groups * n, L] (row g * n + i is row i). A step's layers can share one."""
    b, _, n, L = mask.shape
    return mask[:, :, None].expand(b, 1, groups, n, L).reshape(b, 1, groups * n, L)


def grouped_sdpa(query, key, value, mask=None, scale=None, mask_grouped: bool = False):
    """SDPA of query [B, H, n, D] on key/value [B, H_kv, L, D], each group of H / H_kv query heads
    folded into one query block of its key/value head; mask [b, 1, n, L] or None (or, with
    `mask_grouped`, already grouped_mask's [b, 1, groups * n, L]). -> [B, H, n, D]."""
    B, H, n, D = query.shape
    groups = H // key.shape[1]
    q = query.reshape(B, H // groups, groups * n, D)   # heads h = kv * groups + g: row g * n + i
    if mask is not None and n > 1 and not mask_grouped:
        mask = grouped_mask(mask, groups)
    if tree_attention.applies(q, key, mask, n):  # a tree verify or a one-token step the kernel serves
        return tree_attention.attention(q, key, value, mask, scale).view(B, H, n, D)
    return F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scale).view(B, H, n, D)


def gqa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                  is_causal=None, **kwargs):
    """transformers attention-interface signature: query [B, H, n, D], key/value [B, H_kv, L, D];
    returns ([B, n, H, D], None) like `sdpa_attention_forward`."""
    mask = attention_mask
    if (getattr(module, "num_key_value_groups", 1) == 1 or dropout or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None or (query.shape[2] > 1 and mask is None)
            or (mask is not None and mask.shape[1] != 1)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    return grouped_sdpa(query, key, value, mask, scaling).transpose(1, 2).contiguous(), None


if AVAILABLE:
    AttentionInterface.register(NAME, gqa_attention)
    # masks are made exactly as for `sdpa` (a custom name without one would get no mask at all)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS.get("sdpa", sdpa_mask))


def applies(model) -> bool:
    """A CPU model with grouped key/value heads that runs transformers' `sdpa` attention."""
    c = model.config
    heads, kv = getattr(c, "num_attention_heads", None), getattr(c, "num_key_value_heads", None)
    return (AVAILABLE and getattr(c, "_attn_implementation", None) == "sdpa" and model.device.type == "cpu"
            and bool(heads) and bool(kv) and kv < heads)


def use_gqa_attention(model) -> bool:
    """Switch `model` to this attention where it applies; returns whether it did."""
    if not applies(model):
        return False
    model.set_attn_implementation(NAME)
    return True


def uses_gqa_attention(model) -> bool:
    return getattr(model.config, "_attn_implementation", None) == NAME


@contextmanager
def stock_attention(model):
    """Temporarily run a model switched to this attention on transformers' own `sdpa` (the reference)."""
    switched = uses_gqa_attention(model)
    if switched:
        model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        if switched:
            model.set_attn_implementation(NAME)


__all__ = ["NAME", "grouped_mask", "grouped_sdpa", "gqa_attention", "use_gqa_attention", "uses_gqa_attention", "stock_attention"]
