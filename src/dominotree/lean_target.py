"""The target's CPU step path: a Llama or Qwen3 decoder run directly on its weights, the same numbers.

A one-token step of the embedded 135M target spends about a third of its time outside its
kernels: per layer seven linear calls, two RMSNorms of eight small ops, the cache update and the
nn.Module and keyword plumbing around them. `LeanLlama` runs the same decoder with, per layer,
one oneDNN-packed product for q/k/v and one for gate/up, the model's own rotary module once per
step, the model's configured attention function (the packed GQA one, its tree mask grouped once
per step rather than per layer, or transformers' `sdpa` under `gqa=0`) and the model's
DynamicCache, so `commit` and `rollback` work as before. Every output column comes from the same
packed kernel as in the module path, so a step's logits and features are bit-identical to it in
bf16 (in fp32 up to MKL's rounding of the fused products; tests/test_lean_target.py); plain decoding is 1.31x faster per token here, DominoTree 1.22x
(docs/RESULTS.md, "Lean target path").
It takes about the same milliseconds off a one-token step and a tree verify, so it raises every
method's tokens per second and lowers speedups over plain decoding.

It serves only what it reproduces: Llama-layout models (no biases, SiLU MLP; Qwen3's per-head q/k
norms too, without sliding windows) whose linears are packed (bf16 or fp32) and enabled (packed.py),
on steps of at most MAX_PACKED_ROWS tokens onto a cache the prefill has started. Everything else,
prompts included, keeps transformers' forward: the reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .gqa_attention import NAME as GQA_NAME
from .gqa_attention import grouped_mask, grouped_sdpa
from .packed import (MAX_PACKED_ROWS, PACKED_DTYPES, PackedLinear, kept_or_new, lean_off, pack_weight,
                      packed_linear, pairs_single, row_behaviour, weight_key)

try:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import eager_attention_forward as eager
except ImportError:   # a transformers without the attention registry: the lean path stays off
    ALL_ATTENTION_FUNCTIONS = None

LAYOUT = ("llama", "qwen3")   # model types whose decoder this file reproduces
PRODUCTS = ("qkv", "o", "gate_up", "down")


def _linears(model) -> list[torch.nn.Module]:
    return [m for layer in model.model.layers for m in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                                                        layer.self_attn.v_proj, layer.self_attn.o_proj,
                                                        layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]


def supported(model) -> bool:
    """A Llama-layout decoder this path reproduces (whatever its weights' state)."""
    c = model.config
    return (ALL_ATTENTION_FUNCTIONS is not None and getattr(c, "model_type", None) in LAYOUT
            and not getattr(c, "attention_bias", False) and not getattr(c, "mlp_bias", False)
            and getattr(c, "hidden_act", None) == "silu" and getattr(c, "pretraining_tp", 1) == 1
            and hasattr(model, "model") and hasattr(model.model, "rotary_emb")
            and all(getattr(layer.self_attn, "sliding_window", None) is None for layer in model.model.layers))


def state_key(model) -> tuple | None:
    """What a LeanLlama is built from (None: the model cannot take the lean path now)."""
    if not supported(model):
        return None
    linears = _linears(model)
    dtypes = {m.weight.dtype for m in linears}
    if len(dtypes) != 1 or not dtypes <= set(PACKED_DTYPES) or not all(
            type(m) is PackedLinear and m.packed_enabled and m.weight.device.type == "cpu" for m in linears):
        return None
    norms = [w for layer in model.model.layers
             for w in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
             + tuple(n.weight for n in _head_norms(layer.self_attn) if n is not None)]
    return tuple(weight_key(w) for w in [m.weight for m in linears] + norms + [model.model.norm.weight])


def _head_norms(attn) -> tuple:
    """Qwen3's per-head RMSNorms on queries and keys (None, None for Llama)."""
    return getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)


def _pack(*linears) -> torch.Tensor:
    return pack_weight(torch.cat([m.weight.detach() for m in linears]))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm: normalised in float32, scaled in the input dtype."""
    h = x.float()       # in-place where the value is a temporary: the same ops, fewer buffers
    h = h * h.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return weight * h.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


class LeanLlama:
    """Fused packed weights of one Llama-layout (or Qwen3) model, built from its current weights (see
    lean_for)."""

    def __init__(self, model, key: tuple):
        self.model, self.key = model, key      # key: state_key(model) as the weights were read
        c = model.config
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.inter, self.eps = c.intermediate_size, c.rms_norm_eps
        self.layers = []
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append({
                "attn": a,
                "qkv": _pack(a.q_proj, a.k_proj, a.v_proj), "o": _pack(a.o_proj),
                "gate_up": _pack(m.gate_proj, m.up_proj), "down": _pack(m.down_proj),
                "norm1": layer.input_layernorm.weight.detach(),
                "norm2": layer.post_attention_layernorm.weight.detach(),
                "head_norms": tuple(None if m is None else m.weight.detach() for m in _head_norms(a)),
            })
        # products whose lone rows oneDNN computes otherwise than rows among others (packed.py)
        first = self.layers[0] if self.layers else {}
        self.paired = {name: name in first and pairs_single(first[name]) for name in PRODUCTS}
        self.rows_agree = all(row_behaviour(first[name]).rows_agree for name in first if name in PRODUCTS)

    def applies(self, cache, n: int, mask) -> bool:
        """Whether this step can run here: a short step (a single token, or a masked tree) onto a
        cache the prefill has filled (it fills every layer at once)."""
        first = cache.layers[0] if len(cache.layers) == len(self.layers) else None
        return (n <= MAX_PACKED_ROWS and (n == 1 or mask is not None)
                and getattr(first, "keys", None) is not None and first.keys.numel() > 0)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, mask, cache, taps: list[int]):
        """ids [n] at positions [n] onto `cache`, mask [1, 1, n, L] additive (None for one token).
        -> (last hidden state [n, h] after the final norm, {tap layer: its output [n, h]})."""
        m, n = self.model.model, ids.shape[0]
        H, Hkv, hd = self.heads, self.kv_heads, self.head_dim
        impl = self.model.config._attn_implementation
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager)
        # the packed GQA attention as gqa_attention would run it, its mask grouped once per step
        grouped = impl == GQA_NAME and H > Hkv
        gmask = grouped_mask(mask, H // Hkv) if grouped and mask is not None and n > 1 else mask
        x = m.embed_tokens(ids)[None]
        cos, sin = m.rotary_emb(x, positions[None])
        cos, sin = cos[:, None], sin[:, None]
        wanted, feats, pair = set(taps), {}, self.paired
        for i, (w, held) in enumerate(zip(self.layers, cache.layers)):
            qkv = packed_linear(rms_norm(x, w["norm1"], self.eps), w["qkv"], pair_single=pair["qkv"])
            q_norm, k_norm = w["head_norms"]
            if q_norm is None:      # queries and keys rotated in one pass: the same elementwise ops
                qk = rotate(qkv[..., :(H + Hkv) * hd].view(1, n, H + Hkv, hd).transpose(1, 2), cos, sin)
                q, k = qk[:, :H], qk[:, H:]
            else:
                q, k = qkv[..., :H * hd].view(1, n, H, hd), qkv[..., H * hd:(H + Hkv) * hd].view(1, n, Hkv, hd)
                q, k = rms_norm(q, q_norm, self.eps), rms_norm(k, k_norm, self.eps)
                q, k = rotate(q.transpose(1, 2), cos, sin), rotate(k.transpose(1, 2), cos, sin)
            v = qkv[..., (H + Hkv) * hd:].view(1, n, Hkv, hd).transpose(1, 2)
            held.keys = torch.cat([held.keys, k], -2)        # as DynamicCache.update does
            held.values = torch.cat([held.values, v], -2)
            if grouped:
                out = grouped_sdpa(q, held.keys, held.values, gmask, w["attn"].scaling,
                                   mask_grouped=True).transpose(1, 2)
            else:
                out, _ = attention(w["attn"], q, held.keys, held.values, mask, dropout=0.0, scaling=w["attn"].scaling)
            x = x + packed_linear(out.reshape(1, n, H * hd), w["o"], pair_single=pair["o"])
            gate_up = packed_linear(rms_norm(x, w["norm2"], self.eps), w["gate_up"], pair_single=pair["gate_up"])
            x = x + packed_linear(F.silu(gate_up[..., :self.inter]).mul_(gate_up[..., self.inter:]), w["down"],
                                  pair_single=pair["down"])
            if i in wanted:
                feats[i] = x[0]
        x = rms_norm(x, m.norm.weight, self.eps)[0]
        last = len(self.layers) - 1
        if last in wanted:      # transformers' last hidden state is the normed one
            feats[last] = x
        return x, feats


def lean_for(model, kept: LeanLlama | None) -> LeanLlama | None:
    """The lean path for `model` as its weights and packing are now: `kept` if still current, a new
    one if the model can take it, else None."""
    return kept_or_new(kept, kept is not None and kept.model is model, state_key(model), lambda key: LeanLlama(model, key))


def transformers_forward(target):
    """Context manager: step `target` on transformers' forward (the reference), e.g. for an A/B."""
    return lean_off(target)
