"""Batched target decoding with a preallocated KV cache, for writing training data on a GPU.

`train/data.py` decodes through the HF model with a DynamicCache, which concatenates every
layer's cache at every step: cheap for the CPU's batches of 64, but for the thousands of rows a
GPU holds the copies dominate. Here each layer's K/V live in one buffer that rows write into at a
shared column (prompts are left-padded, so every row's next token lands in the same column), and
attention reads the filled prefix. Llama-family targets only (the embedded SmolLM2 is one): the
layer math is the HF Llama layer's, which tests/test_batch_decode.py checks token for token."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..drafters.dflash import apply_rope, rms_norm, rope_cos_sin


class BatchDecoder:
    def __init__(self, model):
        cfg = model.config
        if getattr(cfg, "model_type", None) != "llama":
            raise ValueError(f"BatchDecoder implements Llama layers; got model_type {cfg.model_type!r}")
        self.model = model
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", self.heads)
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = cfg.rms_norm_eps
        rope = getattr(cfg, "rope_parameters", None) or {}
        self.theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"BatchDecoder implements default rotary embeddings, not {rope['rope_type']!r}")
        w = model.model
        self.layers = []
        for layer in w.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append(dict(
                ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
                qkv=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), o=a.o_proj.weight,
                gate_up=torch.cat([m.gate_proj.weight, m.up_proj.weight]), down=m.down_proj.weight))
        self.embed = w.embed_tokens.weight
        self.norm = w.norm.weight
        self.lm_head = model.get_output_embeddings().weight

    def _forward(self, ids, pos, cache, col, key_ok):
        """ids, pos: [B, T], written at cache columns col..col+T-1; key_ok: [B, T, col+T] bool.
        The G query heads that share a KV head attend as G*T rows of that head (no K/V copies)."""
        B, T = ids.shape
        H, KV, d = self.heads, self.kv_heads, self.head_dim
        G = H // KV
        cos, sin = (t[:, :, None] for t in rope_cos_sin(pos, d, self.theta))    # [B, T, 1, d]
        mask = key_ok[:, None].repeat(1, 1, G, 1) if T > 1 else key_ok[:, None]   # [B, 1, G*T or 1, K]
        x = self.embed[ids]
        for L, (kc, vc) in zip(self.layers, cache):
            h = rms_norm(x, L["ln1"], self.eps)
            q, k, v = F.linear(h, L["qkv"]).split([H * d, KV * d, KV * d], -1)
            q = apply_rope(q.view(B, T, H, d), cos, sin)
            kc[:, :, col:col + T] = apply_rope(k.view(B, T, KV, d), cos, sin).transpose(1, 2)
            vc[:, :, col:col + T] = v.view(B, T, KV, d).transpose(1, 2)
            q = q.view(B, T, KV, G, d).permute(0, 2, 3, 1, 4).reshape(B, KV, G * T, d)
            att = F.scaled_dot_product_attention(q, kc[:, :, :col + T], vc[:, :, :col + T], attn_mask=mask)
            att = att.view(B, KV, G, T, d).permute(0, 3, 1, 2, 4).reshape(B, T, H * d)
            x = x + F.linear(att, L["o"])
            g, u = F.linear(rms_norm(x, L["ln2"], self.eps), L["gate_up"]).chunk(2, -1)
            x = x + F.linear(F.silu(g) * u, L["down"])
        return F.linear(rms_norm(x[:, -1], self.norm, self.eps), self.lm_head)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_ids, temperature: float = 0.0,
                 generator: torch.Generator | None = None, pad_id: int = 0,
                 compact_every: int = 16) -> list[list[int]]:
        """Each prompt's response (eos included when reached), greedy at temperature 0, else sampled.
        Every `compact_every` steps, once a quarter of the rows still in the batch have finished,
        they leave it (their cache rows too): a batch no longer runs at full width for its longest answer."""
        if not prompts or min(len(p) for p in prompts) == 0:
            raise ValueError("generate needs non-empty prompts")
        dev, dt = self.embed.device, self.embed.dtype
        B, W = len(prompts), max(len(p) for p in prompts)
        width = W + max_new_tokens
        ids = torch.full((B, W), pad_id, dtype=torch.long)
        pad = torch.tensor([W - len(p) for p in prompts])
        for i, p in enumerate(prompts):
            ids[i, W - len(p):] = torch.tensor(p)
        ids, pad = ids.to(dev), pad.to(dev)
        cols = torch.arange(width, device=dev)
        cache = [(torch.empty(B, self.kv_heads, width, self.head_dim, device=dev, dtype=dt),
                  torch.empty(B, self.kv_heads, width, self.head_dim, device=dev, dtype=dt))
                 for _ in self.layers]
        valid = cols[None] >= pad[:, None]                                   # [B, width] not padding
        causal = cols[:W, None] >= cols[None, :W]
        # a padding query row sees only itself, so no row of the mask is empty (SDPA would give NaN)
        prefill_ok = (valid[:, None, :W] & causal[None]) | torch.eye(W, dtype=torch.bool, device=dev)[None]
        pos = (cols[None, :W] - pad[:, None]).clamp_min(0)
        logits = self._forward(ids, pos, cache, 0, prefill_ok)
        eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=dev)
        out = torch.full((B, max_new_tokens), -1, dtype=torch.long, device=dev)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        next_pos = W - pad
        rows = torch.arange(B, device=dev)          # the original row of each row still in the batch
        for step in range(max_new_tokens):
            if temperature > 0:
                probs = torch.softmax(logits.float() / temperature, -1)
                nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]
            else:
                nxt = logits.argmax(-1)
            out[rows, step] = torch.where(done, -1, nxt)
            done = done | torch.isin(nxt, eos)
            if step + 1 == max_new_tokens or bool(done.all()):
                break
            if (step + 1) % compact_every == 0 and 4 * int(done.sum()) >= len(done):
                keep = (~done).nonzero()[:, 0]
                cache = [(kc[keep], vc[keep]) for kc, vc in cache]
                rows, valid, next_pos, nxt, done = rows[keep], valid[keep], next_pos[keep], nxt[keep], done[keep]
            col = W + step
            key_ok = valid[:, None, :col + 1]
            logits = self._forward(nxt[:, None], next_pos[:, None], cache, col, key_ok)
            next_pos = next_pos + 1
        res = []
        for row in out.tolist():
            n = row.index(-1) if -1 in row else len(row)
            res.append(row[:n])
        return res
