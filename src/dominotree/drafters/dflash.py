"""DFlashDrafter: the parallel block drafter.

Qwen3-style layers with no embedding and no LM head of their own (the target's are reused).
Context = features of a few target layers, projected by `fc` and normed by `hidden_norm` once,
then injected as extra keys/values into every layer (KV injection). Queries come from the block
[root, MASK x (b-1)] only; attention inside the block is bidirectional. Context K/V are cached
across rounds, block K/V never are.

Optional anchor fusion (`dflash_config.anchor_fusion`, off in the published layout): the projected
context feature of the position just before the root is also added to every block input, through
`anchor_proj` and a per-channel `anchor_scale` that starts at zero, as EAGLE feeds its feature
beside the token, instead of leaving attention to find it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..gqa_attention import grouped_sdpa
from ..packed import MAX_PACKED_ROWS


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass
class DrafterConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    # Domino head (projector_type == "domino"); absent for a plain DFlash drafter
    projector_type: str | None = None
    emb_dim: int = 256
    gru_hidden_dim: int = 1024
    pure_draft_prefix_len: int = 1
    shift_label: bool = False
    anchor_fusion: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def is_domino(self) -> bool:
        return self.projector_type == "domino"

    @property
    def num_depths(self) -> int:
        """Draft depths per round: b with shift_label (position d predicts d + 1), else b - 1."""
        return self.block_size if self.shift_label else self.block_size - 1

    @classmethod
    def from_hf_dict(cls, d: dict) -> "DrafterConfig":
        dc = d.get("dflash_config") or {}
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        theta = d.get("rope_theta", rope.get("rope_theta", 1_000_000.0))
        n_layers = d["num_hidden_layers"]
        n_target = d.get("num_target_layers")
        ids = dc.get("target_layer_ids") or d.get("target_layer_ids")
        if ids is None:
            if n_target is None:
                raise ValueError("config has neither dflash_config.target_layer_ids nor num_target_layers")
            ids = default_target_layer_ids(n_target, n_layers)
        mask = dc.get("mask_token_id", d.get("mask_token_id"))
        if mask is None:
            raise ValueError("config lacks dflash_config.mask_token_id")
        heads = d["num_attention_heads"]
        return cls(
            hidden_size=d["hidden_size"], num_hidden_layers=n_layers, num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads", heads),
            head_dim=d.get("head_dim") or d["hidden_size"] // heads, intermediate_size=d["intermediate_size"],
            vocab_size=d["vocab_size"], num_target_layers=n_target or max(ids) + 1,
            target_layer_ids=list(ids), mask_token_id=int(mask), block_size=d.get("block_size", 16),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            projector_type=dc.get("projector_type"),
            emb_dim=dc.get("emb_dim", d.get("emb_dim", 256)),
            gru_hidden_dim=dc.get("gru_hidden_dim", d.get("gru_hidden_dim", dc.get("emb_dim", 256))),
            pure_draft_prefix_len=dc.get("pure_draft_prefix_len", 1),
            shift_label=bool(dc.get("shift_label", False)),
            anchor_fusion=bool(dc.get("anchor_fusion", False)))

    def to_hf_dict(self) -> dict:
        dc = {"mask_token_id": self.mask_token_id, "target_layer_ids": self.target_layer_ids}
        if self.shift_label:
            dc["shift_label"] = True      # block position d predicts depth d + 1
        if self.anchor_fusion:
            dc["anchor_fusion"] = True    # extra tensors anchor_proj.weight, anchor_scale (not in the published layout)
        arch = "DFlashDraftModel"
        d = {
            "architectures": [arch], "model_type": "qwen3", "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
            "num_target_layers": self.num_target_layers, "block_size": self.block_size,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "hidden_act": "silu",
            "attention_bias": False, "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": False, "dflash_config": dc,
        }
        if self.is_domino:
            d["architectures"] = ["DominoDraftModel"]
            d["emb_dim"] = self.emb_dim
            dc.update(projector_type="domino", emb_dim=self.emb_dim, gru_hidden_dim=self.gru_hidden_dim,
                      pure_draft_prefix_len=self.pure_draft_prefix_len, shift_label=self.shift_label)
        return d


# ---------------------------------------------------------------------------- building blocks
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, scaled in the input's dtype (as HF Qwen3)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, d: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary cos and sin for positions [..., T]: float32 [..., T, d] each (elementwise, so a row
    is the same whether computed alone or in a table; drafters/lean.py keeps one)."""
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=positions.device, dtype=torch.float32) / d))
    ang = positions.float()[..., None] * inv            # [..., T, d/2]
    ang = torch.cat([ang, ang], -1)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, D] rotated by cos/sin broadcastable to it (half-split layout, as HF Llama/Qwen)."""
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    rotated = torch.cat([-x2, x1], -1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding. x: [B, H, T, D], positions: [B, T]."""
    cos, sin = rope_cos_sin(positions, x.shape[-1], theta)
    return apply_rope(x, cos[:, None], sin[:, None])


class DraftAttention(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c = c
        h, hd = c.hidden_size, c.head_dim
        self.q_proj = nn.Linear(h, c.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, c.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, c.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(hd, c.rms_norm_eps)

    def kv(self, x: torch.Tensor, positions: torch.Tensor):
        """Keys (normed, rotated) and values for x [B, T, h] at positions [B, T]."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, -1, self.c.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.c.head_dim).transpose(1, 2)
        return rope(k, positions, self.c.rope_theta), v

    def forward(self, x, positions, ctx_k, ctx_v, mask):
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, -1, self.c.head_dim)).transpose(1, 2)
        q = rope(q, positions, self.c.rope_theta)
        k, v = self.kv(x, positions)
        k, v = torch.cat([ctx_k, k], 2), torch.cat([ctx_v, v], 2)
        rep = self.c.num_attention_heads // self.c.num_key_value_heads
        if rep > 1 and mask is None:
            # a draft: each group of query heads as one block of its key/value head, no K/V copies
            # (4% faster drafts, the same outputs up to rounding)
            out = grouped_sdpa(q, k, v)
        else:
            if rep > 1:
                k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # no causal mask: bidirectional block
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class DraftMLP(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.self_attn = DraftAttention(c)
        self.mlp = DraftMLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, positions, ctx_k, ctx_v, mask):
        x = x + self.self_attn(self.input_layernorm(x), positions, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashBackbone(nn.Module):
    """The trainable part of a DFlash drafter; parameter names follow the published layout."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.config = c
        self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c.num_hidden_layers))
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.anchor_fusion:
            self.anchor_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=False)
            # per-channel scale from zero (LayerScale): the fused feature fades in. A zero matrix
            # instead gets Adam's sign-like first steps as a rank-1 jump (measured: +0.24 nats at once).
            self.anchor_scale = nn.Parameter(torch.zeros(c.hidden_size))

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        return self.hidden_norm(self.fc(features))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor):
        """Per-layer context keys/values for projected context ctx [B, C, h]."""
        return [layer.self_attn.kv(ctx, positions) for layer in self.layers]

    def forward(self, block_emb, positions, ctx_kv, mask=None, anchor_ctx=None):
        """block_emb [B, T, h] at positions [B, T]; ctx_kv from context_kv; mask [B, 1, T, C + T] bool;
        anchor_ctx [B, T or 1, h]: the projected context before each block's root (anchor fusion only)."""
        x = block_emb
        if self.config.anchor_fusion:
            if anchor_ctx is None:
                raise ValueError("an anchor-fusion drafter needs anchor_ctx (the context feature before the root)")
            x = x + self.anchor_scale * self.anchor_proj(anchor_ctx)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, positions, k, v, mask)
        return self.norm(x)


# ---------------------------------------------------------------------------- inference wrapper
class DraftOutput:
    """A draft: backbone output `hidden` [D, h] for depths 1..D and base logits for depths 1..D'
    (D' <= D: `draft(depths=)`), float32.

    With a draft vocabulary (`vocab`, a DraftVocab) the logits are kept compact, [D', N] over its
    token ids: `scores()` hands them to the builders that work on them, and `base_logits`, the
    vocabulary-wide [D', V] view (-inf off the subset), is made only if something reads it."""

    def __init__(self, hidden: torch.Tensor, base_logits: torch.Tensor | None = None,
                 vocab=None, vocab_logits: torch.Tensor | None = None):
        if (base_logits is None) == (vocab_logits is None) or (vocab is None) != (vocab_logits is None):
            raise ValueError("a DraftOutput takes either base_logits or a vocab with its vocab_logits")
        self.hidden, self.vocab, self._full, self._compact = hidden, vocab, base_logits, vocab_logits

    @property
    def base_logits(self) -> torch.Tensor:
        """[D', V] float32 logits over the whole vocabulary (-inf off a draft vocabulary)."""
        if self._full is None:
            self._full = self.vocab.expand(self._compact)
        return self._full

    @base_logits.setter
    def base_logits(self, value: torch.Tensor) -> None:
        self._full, self._compact, self.vocab = value, None, None

    def scores(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [D', N], token ids [N]) over the draft vocabulary, or (base_logits, None) without
        one: what a builder scans instead of the vocabulary-wide rows."""
        if self._compact is None:
            return self._full, None
        return self._compact, self.vocab.ids


class DFlashDrafter:
    """A backbone bound to a target at draft time; keeps the context K/V cache of one request."""

    def __init__(self, backbone: DFlashBackbone, name: str = "dflash"):
        self.backbone = backbone.eval()
        self.config = backbone.config
        self.name = name
        self.use_lean = True
        self._lean_kept = None    # drafters/lean.LeanBackbone, made on first use, kept across requests
        self.reset()

    def __getstate__(self):
        # the lean path holds opaque oneDNN tensors (nothing to copy or pickle): a copy remakes it
        return {**self.__dict__, "_lean_kept": None, "_request_lean": None}

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.target_layer_ids

    @property
    def num_depths(self) -> int:
        return self.config.num_depths

    @property
    def dtype(self) -> torch.dtype:
        return self.backbone.fc.weight.dtype

    def to(self, dtype=None, device=None) -> "DFlashDrafter":
        self.backbone.to(device=device, dtype=dtype)
        return self

    def reset(self) -> None:
        self._ctx_kv = None
        self._last_ctx = None     # projected context of the last position (anchor fusion)
        self.ctx_len = 0
        self._request_lean = None   # (use_lean, lean path) as checked at this request's first call

    def check_fits(self, target) -> None:
        from .checkpoint import check_fits
        check_fits(self.config, target, self.backbone)

    @torch.inference_mode()
    def add_context(self, features: torch.Tensor, start: int) -> None:
        """Append target features of tokens at positions start.. (contiguous with what is cached)."""
        if start != self.ctx_len:
            raise RuntimeError(f"drafter context is at {self.ctx_len}, got features from position {start}")
        n = features.shape[0]
        if n == 0:
            return
        ctx = self.backbone.project_context(features[None].to(self.dtype))
        lean = self._lean_now() if n <= MAX_PACKED_ROWS else None   # a prompt's rows take the plain kernels
        if lean is not None:
            new = lean.context_kv(ctx, start)
        else:
            new = self.backbone.context_kv(ctx, torch.arange(start, start + n, device=ctx.device)[None])
        self._last_ctx = ctx[:, -1:]
        if self._ctx_kv is None:
            self._ctx_kv = new
        else:
            self._ctx_kv = [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2))
                            for (k0, v0), (k1, v1) in zip(self._ctx_kv, new)]
        self.ctx_len += n

    @torch.inference_mode()
    def block_hidden(self, root: int, start: int, target) -> torch.Tensor:
        """Backbone output for the block [root, MASK x (b - 1)] at positions start.. : [b, h]."""
        if self._ctx_kv is None or start != self.ctx_len:
            raise RuntimeError("drafter context does not reach the root position; call add_context first")
        b = self.config.block_size
        ids = torch.full((b,), self.config.mask_token_id, dtype=torch.long)
        ids[0] = root
        emb = target.embed(ids)[None].to(self.dtype)
        lean = self._lean_now()
        if lean is not None:
            return lean.forward(emb, start, self._ctx_kv)[0]
        pos = torch.arange(start, start + b)[None]
        return self.backbone(emb, pos, self._ctx_kv, anchor_ctx=self._last_ctx)[0]

    def lean(self):
        """The CPU fast path (drafters/lean.py) while the backbone can take it, else None; `use_lean
        = False` keeps the module path, the reference."""
        if not self.use_lean:
            return None
        from .lean import lean_for
        self._lean_kept = lean_for(self.backbone, self._lean_kept)
        return self._lean_kept

    def _lean_now(self):
        """`lean()` as it was at this request's first call. Checking the weights' state costs ~0.4 ms
        (a key over every parameter), twice a round; like the target, a request checks it once, so
        weights changed in place take effect from the next `reset`."""
        if self._request_lean is None or self._request_lean[0] != self.use_lean:
            self._request_lean = (self.use_lean, self.lean())
        return self._request_lean[1]

    @torch.inference_mode()
    def draft(self, root: int, start: int, target, depths: int | None = None, vocab=None) -> DraftOutput:
        """The block's outputs; base logits for the first `depths` depths only (the LM head is
        half a draft's cost, and a tree of B nodes is never deeper than B), over the tokens of
        `vocab` only if given (a DraftVocab: kept compact, see DraftOutput)."""
        h = self.block_hidden(root, start, target)
        h = h if self.config.shift_label else h[1:]
        rows = (h if depths is None else h[:max(1, depths)]).to(target.dtype)
        if vocab is None:
            return DraftOutput(h, target.lm_head(rows).float())
        return DraftOutput(h, vocab=vocab, vocab_logits=vocab.compact(rows))
