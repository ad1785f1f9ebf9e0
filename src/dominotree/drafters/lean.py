"""The drafter's CPU inference path: fewer, larger calls on the same kernels, the same numbers.

At the 16 rows of a draft block, most of a draft layer's time on CPU is per-call overhead: seven
linear calls, four RMSNorms of eight small ops each, rotary angles recomputed per call, and the
nn.Module calls around them. `LeanBackbone` keeps, per layer, one oneDNN-packed product for
q/k/v (k/v alone for new context rows) and one for gate/up, and takes rotary cos/sin from a table.
Every row and column is computed by the same packed kernel as in DFlashBackbone, so a draft's
hidden states are bit-identical to the module path in bf16 (in fp32 up to MKL's rounding of the
fused products; tests/test_lean.py); on the
embedded drafter a round's draft and context update take ~0.9 ms less (docs/RESULTS.md).

It serves only what it reproduces: bf16 or fp32 backbones whose linears are packed and enabled
(packed.py), no anchor fusion, at most MAX_PACKED_ROWS rows per call. Anything else, and the
training, keeps DFlashBackbone's forward, which stays the reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..gqa_attention import grouped_sdpa
from ..packed import (MAX_PACKED_ROWS, PACKED_DTYPES, PackedLinear, kept_or_new, lean_off, pack_weight,
                       packed_linear, weight_key)
from .dflash import DFlashBackbone, apply_rope, rms_norm, rope_cos_sin


def _pack(*weights: torch.Tensor) -> torch.Tensor:
    return pack_weight(torch.cat([w.detach() for w in weights]))


def _linears(backbone: DFlashBackbone) -> list[torch.nn.Module]:
    return [m for layer in backbone.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]


def state_key(backbone: DFlashBackbone) -> tuple | None:
    """What a LeanBackbone is built from (None: the backbone cannot take the lean path)."""
    c = backbone.config
    linears = _linears(backbone)
    dtypes = {m.weight.dtype for m in linears}
    if c.anchor_fusion or c.block_size > MAX_PACKED_ROWS or len(dtypes) != 1 or not dtypes <= set(PACKED_DTYPES) \
            or not all(type(m) is PackedLinear and m.packed_enabled and m.weight.device.type == "cpu" for m in linears):
        return None
    return tuple(weight_key(p) for p in backbone.parameters())


class LeanBackbone:
    def __init__(self, backbone: DFlashBackbone, key: tuple):
        c = self.config = backbone.config
        self.backbone = backbone
        self.key = key
        self.layers = []
        for layer in backbone.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append({
                "qkv": _pack(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight),
                "kv": _pack(a.k_proj.weight, a.v_proj.weight),
                "o": _pack(a.o_proj.weight),
                "gate_up": _pack(m.gate_proj.weight, m.up_proj.weight),
                "down": _pack(m.down_proj.weight),
                "q_norm": a.q_norm.weight.detach(), "k_norm": a.k_norm.weight.detach(),
                "norm1": layer.input_layernorm.weight.detach(),
                "norm2": layer.post_attention_layernorm.weight.detach(),
            })
        self.norm = backbone.norm.weight.detach()
        self.cos = self.sin = torch.empty(0, c.head_dim)

    def _rotary(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows of positions start..start + n - 1, from a table grown by doubling."""
        if start + n > len(self.cos):
            size = max(2 * len(self.cos), start + n, 1024)
            self.cos, self.sin = rope_cos_sin(torch.arange(size), self.config.head_dim, self.config.rope_theta)
        return self.cos[start:start + n], self.sin[start:start + n]

    def _heads(self, x: torch.Tensor, lo: int, count: int, norm: torch.Tensor | None) -> torch.Tensor:
        """Columns lo.. of a fused product as [1, count, n, head_dim], normed if `norm`."""
        n, hd = x.shape[1], self.config.head_dim
        h = x[..., lo * hd:(lo + count) * hd].view(1, n, count, hd)
        if norm is not None:
            h = rms_norm(h, norm, self.config.rms_norm_eps)
        return h.transpose(1, 2)

    def context_kv(self, ctx: torch.Tensor, start: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """DFlashBackbone.context_kv for projected context ctx [1, n, h] at positions start.."""
        c, n = self.config, ctx.shape[1]
        cos, sin = self._rotary(start, n)
        out = []
        for w in self.layers:
            kv = packed_linear(ctx, w["kv"])
            k = apply_rope(self._heads(kv, 0, c.num_key_value_heads, w["k_norm"]), cos, sin)
            out.append((k, self._heads(kv, c.num_key_value_heads, c.num_key_value_heads, None)))
        return out

    def forward(self, block_emb: torch.Tensor, start: int, ctx_kv) -> torch.Tensor:
        """DFlashBackbone.forward for block_emb [1, b, h] at positions start.. (no mask)."""
        c, b = self.config, block_emb.shape[1]
        H, Hkv, inter, eps = c.num_attention_heads, c.num_key_value_heads, c.intermediate_size, c.rms_norm_eps
        cos, sin = self._rotary(start, b)
        x = block_emb
        for w, (ctx_k, ctx_v) in zip(self.layers, ctx_kv):
            qkv = packed_linear(rms_norm(x, w["norm1"], eps), w["qkv"])
            q = apply_rope(self._heads(qkv, 0, H, w["q_norm"]), cos, sin)
            k = apply_rope(self._heads(qkv, H, Hkv, w["k_norm"]), cos, sin)
            v = self._heads(qkv, H + Hkv, Hkv, None)
            k, v = torch.cat([ctx_k, k], 2), torch.cat([ctx_v, v], 2)
            out = grouped_sdpa(q, k, v) if H > Hkv else F.scaled_dot_product_attention(q, k, v)
            x = x + packed_linear(out.transpose(1, 2).reshape(1, b, -1), w["o"])
            gate_up = packed_linear(rms_norm(x, w["norm2"], eps), w["gate_up"])
            x = x + packed_linear(F.silu(gate_up[..., :inter]) * gate_up[..., inter:], w["down"])
        return rms_norm(x, self.norm, eps)


def lean_for(backbone: DFlashBackbone, kept: LeanBackbone | None) -> LeanBackbone | None:
    """The lean path for `backbone` as its weights and packing are now: `kept` if still current, a
    new one if the backbone can take it, else None."""
    return kept_or_new(kept, kept is not None and kept.backbone is backbone, state_key(backbone),
                       lambda key: LeanBackbone(backbone, key))


def module_path(drafter):
    """Context manager: draft on the module path (the reference), e.g. for an interleaved A/B."""
    return lean_off(drafter)
