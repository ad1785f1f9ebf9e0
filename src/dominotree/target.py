"""TargetModel: any Hugging Face causal LM, driven through its public forward (a packed
Llama or Qwen3 model steps on lean_target.py instead: the same numbers, fewer calls).

The cache holds every committed token except the newest one (the *root*). A round feeds the
root plus a flattened draft tree in one pass (position = start + depth, 4-D ancestor mask),
then `commit` keeps the accepted path by moving those rows of the cache tail into place.
"""
from __future__ import annotations

import inspect
import logging
import numbers
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from .gqa_attention import stock_attention, use_gqa_attention, uses_gqa_attention
from .lean_target import lean_for, transformers_forward
from .lean_target import state_key as lean_state_key
from .machine import default_dtype
from .models import ModelNotFoundError, resolve_target
from . import fp32_linear, tree_attention
from .packed import PackedLinear, is_packed, pack_linears, packing, row_behaviour
from .trees.tree import DraftTree


@dataclass
class ForwardOutput:
    logits: torch.Tensor               # [n, V] float32
    features: torch.Tensor | None      # [n, len(taps) * hidden] in the model dtype, or None


class TargetModel:
    def __init__(self, model, tokenizer, name: str | None = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "_name_or_path", "target")
        self.config = model.config
        self.tap_layer_ids: list[int] = []
        self.use_lean = True      # step on lean_target.py where it applies; False: transformers' forward
        self._lean = None         # the lean path of this request (None: transformers' forward)
        self._lean_kept = None    # the last one built, kept while the model is switched off it (A/Bs)
        # transformers >= 5.2x names the cache argument `cache` (past_key_values is deprecated)
        params = inspect.signature(self.model.base_model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.reset()

    # ---- facts -----------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def packed(self) -> bool:
        """Whether the linear layers run on pre-packed bf16 or fp32 weights (see packed.py)."""
        return is_packed(self.model)

    @property
    def gqa_attention(self) -> bool:
        """Whether attention runs on the packed grouped-query function (see gqa_attention.py)."""
        return uses_gqa_attention(self.model)

    @property
    def lean(self) -> bool:
        """Whether steps (verify) run on the lean path (lean_target.py) rather than transformers' forward."""
        return self.use_lean and lean_state_key(self.model) is not None

    @property
    def exact_steps(self) -> bool:
        """Whether a one-token step and a tree verify's row of the same token give the same bits on
        this machine, so that greedy speculative decoding gives plain decoding's tokens exactly, not
        up to floating-point near-ties: the lean path on packed weights with grouped attention on the
        tree-attention kernel (rows over the keys they see, in key order), and products that treat
        rows alike (in bf16 oneDNN's, packed.row_behaviour: a lone row that differs runs as two; in
        fp32 the fp32 linear kernel's, whose sums run in k order whatever the rows)."""
        head = self.model.get_output_embeddings()
        if not (self.lean and self.packed and self.gqa_attention and self.device.type == "cpu"
                and self.dtype in tree_attention.KERNEL_DTYPES and tree_attention.enabled(self.dtype)
                and isinstance(head, PackedLinear) and head.packed_enabled
                and (self.dtype != torch.float32 or isinstance(head._packed, fp32_linear.Blocked))):
            return False       # (fp32 on MKL's copy: its lone rows round otherwise, unpaired)
        lean = self._lean_kept = lean_for(self.model, self._lean_kept)     # the path the next request steps on
        return (lean.heads > lean.kv_heads and lean.head_dim in tree_attention.HEAD_SIZES and lean.rows_agree
                and row_behaviour(head._packed, head.bias).rows_agree)

    @contextmanager
    def stock(self):
        """Context manager: run the model's plain transformers path (no packed weights, transformers'
        own `sdpa` attention and forward), e.g. for the transformers peers of the benchmark."""
        with packing(self.model, False), stock_attention(self.model), transformers_forward(self):
            yield

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def max_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 2048))

    @property
    def eos_token_ids(self) -> set[int]:
        ids = set()
        for src in (self.config.eos_token_id, getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(int(x) for x in src)
        return ids

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(token_ids.to(self.device))

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.get_output_embeddings()(hidden)

    def set_taps(self, layer_ids) -> None:
        """Layers whose outputs (HF hidden_states[l + 1]) are returned as features."""
        ids = [int(i) for i in layer_ids]
        bad = [i for i in ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"target layer ids {bad} are outside the target's {self.num_layers} layers")
        self.tap_layer_ids = ids

    # ---- cache state -----------------------------------------------------------------------
    def reset(self) -> None:
        self.cache = DynamicCache(config=self.config)
        self.length = 0      # tokens in the cache
        self._pending = 0    # tokens fed by the last verify, not yet committed

    def rollback(self) -> None:
        """Drop an uncommitted verify pass (e.g. a request that failed mid-round)."""
        if self._pending:
            self._crop(self.length)
            self._pending = 0

    def _crop(self, new_len: int) -> None:
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys[..., :new_len, :]
                layer.values = layer.values[..., :new_len, :]

    # ---- forward passes --------------------------------------------------------------------
    @torch.inference_mode()
    def _forward(self, ids, positions, mask4d, want_features, last_only=False) -> ForwardOutput:
        want = want_features and bool(self.tap_layer_ids)
        lean = self._lean if self.use_lean and not last_only else None
        if lean is not None and lean.applies(self.cache, len(ids), mask4d):
            hidden, feats = lean.forward(ids.to(self.device), positions.to(self.device), mask4d, self.cache,
                                         self.tap_layer_ids if want else [])
            feats = torch.cat([feats[l] for l in self.tap_layer_ids], dim=-1) if want else None
            return ForwardOutput(self.lm_head(hidden).float(), feats)
        out = self.model.base_model(
            input_ids=ids[None].to(self.device), position_ids=positions[None].to(self.device),
            attention_mask=mask4d, use_cache=True, output_hidden_states=want,
            **{self._cache_kw: self.cache})
        hidden = out.last_hidden_state[0]
        if last_only:
            hidden = hidden[-1:]
        logits = self.lm_head(hidden).float()
        feats = None
        if want:
            feats = torch.cat([out.hidden_states[l + 1][0] for l in self.tap_layer_ids], dim=-1)
        return ForwardOutput(logits, feats)

    def prefill(self, token_ids, features: bool = True, chunk: int = 512) -> ForwardOutput:
        """Put a whole prompt into the (empty) cache; logits of the last position, features of all."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        if len(ids) == 0:
            raise ValueError("prefill needs at least one token")
        if len(ids) > self.max_context:
            raise ValueError(f"prompt of {len(ids)} tokens exceeds the context of {self.max_context}")
        self.reset()
        # the lean path as the model is now (weights, packing, switches): checked once per request
        self._lean = lean_for(self.model, self._lean_kept) if self.use_lean else None
        self._lean_kept = self._lean or self._lean_kept
        feats, out = [], None
        for s in range(0, len(ids), chunk):
            part = ids[s:s + chunk]
            out = self._forward(part, torch.arange(s, s + len(part)), None, features, last_only=True)
            if out.features is not None:
                feats.append(out.features)
        self.length = len(ids)
        return ForwardOutput(out.logits, torch.cat(feats) if feats else None)

    def verify(self, tree: DraftTree, features: bool = True) -> ForwardOutput:
        """One pass over root + tree; per-node logits and features. Call `commit` next."""
        if self._pending:
            raise RuntimeError("verify called twice without commit")
        n = len(tree)
        if self.length + tree.max_depth + 1 > self.max_context:
            raise ValueError("draft tree runs past the context limit")
        positions, anc = tree.flatten(self.length)
        mask = None
        if n > 1:  # a single root attends to everything: plain causal decoding needs no mask
            allowed = torch.cat([torch.ones(n, self.length, dtype=torch.bool), anc], dim=1)
            mask = torch.zeros(allowed.shape, dtype=self.dtype)
            mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
            mask = mask[None, None].to(self.device)
        out = self._forward(tree.tokens, positions, mask, features)
        self._pending = n
        return out

    @torch.inference_mode()
    def commit(self, path) -> None:
        """Keep the verified nodes `path` (root first) in the cache; drop the rest of the tail.

        Only the tail written by the last verify is touched, so the cost does not grow with the
        prompt length."""
        path = torch.as_tensor(path, dtype=torch.long).flatten()
        if not self._pending:
            raise RuntimeError("commit without a pending verify")
        if len(path) == 0 or int(path[0]) != 0:
            raise ValueError("an accepted path starts at the root (node 0)")
        start, k = self.length, len(path)
        contiguous = bool(torch.equal(path, torch.arange(k)))
        idx = (start + path).to(self.device)
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is None or not layer.keys.numel():
                continue
            if not contiguous:
                layer.keys[..., start:start + k, :] = layer.keys.index_select(-2, idx)
                layer.values[..., start:start + k, :] = layer.values.index_select(-2, idx)
            layer.keys = layer.keys[..., :start + k, :]
            layer.values = layer.values[..., :start + k, :]
        self.length = start + k
        self._pending = 0

    # ---- text ------------------------------------------------------------------------------
    def encode_prompt(self, prompt, raw: bool = False) -> list[int]:
        """Chat messages (list of {role, content}), token ids, or a string; strings get the chat
        template unless `raw` or the tokenizer has none. Anything else is a clear error here, not
        an IndexError in the embedding or a template's error later."""
        tok = self.tokenizer
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("empty prompt")
            if raw or not getattr(tok, "chat_template", None):
                ids = tok.encode(prompt, add_special_tokens=False)
                if not ids:
                    raise ValueError("empty prompt")
                return ids
            prompt = [{"role": "user", "content": prompt}]
        elif not isinstance(prompt, (list, tuple)):
            raise TypeError(f"a prompt is a string, a list of chat messages or a list of token ids, "
                            f"got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("empty prompt")
        if all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt):
            bad = [int(t) for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the target's vocabulary (0..{self.vocab_size - 1})")
            return [int(t) for t in prompt]
        for i, m in enumerate(prompt):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ValueError(f"chat message {i} must be a dict with 'role' and 'content' strings, got {m!r:.80}")
        if not getattr(tok, "chat_template", None):
            raise ValueError("this tokenizer has no chat template: pass a string (it is encoded raw) or token ids")
        ids = tok.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def decode(self, token_ids) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)


# dtype names accepted by load_target (and the training's --precision values)
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
          "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16}


def load_target(name_or_path: str = "smollm2-135m", dtype: str | torch.dtype | None = None,
                device: str = "cpu", pack: bool = True, gqa: bool = True, lean: bool = True) -> TargetModel:
    """Load the embedded default (by name), any local HF causal-LM directory (offline), or a Hub id
    (owner/name: from the Hugging Face cache, else downloaded unless HF_HUB_OFFLINE is set).

    `dtype` ("bf16", "fp32", "fp16" or a torch dtype): by default bf16, or fp32 on an x86 CPU
    without bf16 hardware (machine.default_dtype); `target.dtype` says which.
    `pack` re-blocks bf16 linear weights on CPU once for oneDNN (packed.py): the same logits,
    faster steps; fp32 weights get a column-major copy for MKL (the logits up to fp32 rounding);
    a no-op for other dtypes and devices. `pack=False` keeps the plain modules.
    `gqa` runs a CPU model with grouped key/value heads on the packed GQA attention
    (gqa_attention.py): the same logits, faster steps; `gqa=False` keeps transformers' `sdpa`.
    `lean` steps a packed Llama or Qwen3 model on its weights directly (lean_target.py): the same
    logits, plain decoding ~1.3x faster; `lean=False` keeps transformers' forward."""
    path = resolve_target(name_or_path)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    # bf16 by default, where it verifies many tokens more cheaply than fp32; fp32 on x86 CPUs
    # without bf16 hardware, where bf16 products are converted to fp32 (machine.default_dtype).
    dtype = dtype or default_dtype(device)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except OSError as e:
        raise ModelNotFoundError(f"cannot load a model from {path}: {e}") from e
    model = model.to(device)
    if pack:
        pack_linears(model)
    if gqa:
        use_gqa_attention(model)
    target = TargetModel(model, tok, name=name_or_path if not Path(name_or_path).is_dir() else str(path))
    target.use_lean = lean
    return target
