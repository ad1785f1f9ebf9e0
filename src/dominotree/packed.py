"""Pre-packed linear layers for CPU inference (bf16 and fp32).

A plain bf16 `F.linear` on CPU hands oneDNN its weight in the plain [out, in] layout, and oneDNN
re-blocks it on every call. Re-blocking once at load time (`mkldnn._reorder_linear_weight`)
made plain decoding 1.19x and DominoTree 1.18x faster on a 2-core AVX-512 CPU (README,
"Pre-packed weights"), with bit-identical outputs there: the same kernel runs, only the
copy is gone.

fp32 goes to MKL, whose `F.linear` (x @ W^T, a "T, N" sgemm) is slow for the 4-128 rows of a tree
verify on the CPUs measured: a 16-row product of SmolLM2's 576x576 projection took 0.31 ms against
0.06 ms for the same product on a column-major copy of W (a "N, N" sgemm), 5x (docs/RESULTS.md,
"fp32 on CPUs without native bf16"). An fp32 weight is therefore packed for fp32_linear.py's
kernel where the CPU has AVX-512F (blocks of 16 outputs, bf16-stored where exact, a row's bits
independent of the rows around it), else as that column-major copy (an [out, in] view of a
contiguous [in, out] tensor, multiplied as it lies). Either rounds otherwise than the plain path
(the sums are blocked otherwise), so fp32 logits are transformers' up to fp32 rounding, not bit
for bit.

`pack_linears` changes the class of a model's CPU bf16 and fp32 `nn.Linear` modules in place, so
parameters, names and `state_dict` stay as they were; the packed copy is a plain attribute (the
linear weights are held twice).
`packing(model, False)` switches back to the plain path (the reference), e.g. to run stock
transformers peers on the same model object.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import fp32_linear
from .machine import cpu_facts

# Above this many rows the plain path is as fast or faster (prefill, batched data generation).
MAX_PACKED_ROWS = 128


PACKED_DTYPES = (torch.bfloat16, torch.float32)


def packing_available() -> bool:
    """True when this torch build has oneDNN's weight re-blocking for bf16 (CPU builds with mkldnn).
    fp32 packing needs nothing of the build."""
    try:
        return torch.backends.mkldnn.is_available() and callable(torch.ops.mkldnn._reorder_linear_weight)
    except (AttributeError, RuntimeError):
        return False


def _packable(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return (type(module) is nn.Linear and w is not None and w.device.type == "cpu"
            and (w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and packing_available())))


BATCH_HINT = 16   # the rows oneDNN blocks a packed weight for


def pack_weight(w: torch.Tensor, batch_hint: int = BATCH_HINT) -> torch.Tensor:
    """w [out, in] re-blocked once: for oneDNN's bf16 kernel (an opaque tensor), or in fp32 as a
    column-major copy (an [out, in] view of a contiguous [in, out] tensor) for MKL's "N, N" sgemm."""
    if w.dtype == torch.float32:
        if fp32_linear.available():
            return fp32_linear.pack(w)
        return w.detach().t().contiguous().t()
    return torch.ops.mkldnn._reorder_linear_weight(w.detach(), batch_hint)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
                  pair_single: bool = False) -> torch.Tensor:
    """F.linear on a weight made by pack_weight. `pair_single` (row_behaviour's `single_differs`):
    a lone row runs as two copies of itself, so it gets the bits it would get among other rows."""
    if isinstance(packed, fp32_linear.Blocked):
        return fp32_linear.linear(x, packed, bias)
    if packed.dtype == torch.float32:       # x @ the contiguous [in, out] tensor: MKL's "N, N" sgemm
        y = torch.matmul(x, packed.t())
        return y if bias is None else y.add_(bias)
    if pair_single and x.numel() == x.shape[-1]:
        two = x.reshape(1, -1).repeat(2, 1)
        out = torch.ops.mkldnn._linear_pointwise(two, packed, bias, "none", [None], "")
        return out[:1].view(*x.shape[:-1], out.shape[-1])
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")


@dataclass(frozen=True)
class RowBehaviour:
    """How oneDNN's kernel for one packed shape treats rows (this process's CPU and threads).
    `single_differs`: a lone row's product is not always that row's among others (oneDNN takes
    another kernel for one row: on this project's EPYC the 1536-wide down projection, one bf16 step
    off in ~1 row of 20). `rows_agree`: among 2 to 64 rows, a row's product never depends on the others.
    With both in hand a one-token step and a tree verify's row of the same token give the same bits."""
    single_differs: bool
    rows_agree: bool


_behaviours: dict = {}
_PROBE_ROWS = (2, 3, 5, 8, 16, 17, 33, 64)   # row counts checked against the whole probe
_PROBE_OUTPUTS = 1 << 17


@torch.inference_mode()
def row_behaviour(packed: torch.Tensor, bias: torch.Tensor | None = None) -> RowBehaviour:
    """Measured once per shape (the first packed weight of that shape) on random rows, each alone
    and among others, as many as make ~128k outputs (17 at least, 128 at most: 128 for a 576-wide
    projection), since a kernel that rounds otherwise shows in ~1 of 10,000 outputs."""
    out_features, in_features = packed.shape
    key = (out_features, in_features, packed.dtype, bias is not None, torch.get_num_threads())
    if key not in _behaviours:
        rows = min(MAX_PACKED_ROWS, max(17, -(-_PROBE_OUTPUTS // out_features)))
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(0)).to(packed.dtype)
        whole = packed_linear(x, packed, bias)
        alone = torch.cat([packed_linear(x[i:i + 1], packed, bias) for i in range(rows)])
        agree = all(torch.equal(packed_linear(x[:m], packed, bias), whole[:m]) for m in _PROBE_ROWS if m < rows)
        _behaviours[key] = RowBehaviour(not torch.equal(alone, whole), agree)
    return _behaviours[key]


def weight_key(w: torch.Tensor) -> tuple[int, int]:
    # inference tensors (made under torch.inference_mode) keep no version counter
    return w.data_ptr(), (-1 if w.is_inference() else w._version)


def pairs_single(packed: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether a lone row should run as two (`packed_linear`'s `pair_single`): for bf16 products
    whose lone-row kernel rounds otherwise, on a CPU that can run the bf16 attention kernel
    (avx512_bf16), without which verifies and steps part anyway (target.exact_steps). Never for
    fp32: the fp32 linear kernel's rows agree alone and among others, and on MKL's copy (no
    kernel) a 49k-wide row pair costs 1.8x one."""
    return (packed.dtype == torch.bfloat16 and "avx512_bf16" in cpu_facts()[1]
            and row_behaviour(packed, bias).single_differs)


class PackedLinear(nn.Linear):
    """An nn.Linear whose bf16 or fp32 forward uses a weight re-blocked once (pack_weight).

    Never constructed directly: `pack_linears` re-classes existing modules. The packed copy is
    rebuilt when the weight is replaced or changed in place."""

    packed_enabled: bool = True

    def _repack(self, batch_hint: int) -> None:
        self._packed = pack_weight(self.weight, batch_hint)
        self._packed_key = weight_key(self.weight)
        self._batch_hint = batch_hint
        self._pair_single = pairs_single(self._packed, self.bias)

    def __getstate__(self):
        # the packed copy is an opaque oneDNN tensor (no storage to copy or pickle): drop it and
        # repack on first use
        state = self.__dict__.copy()
        state.pop("_packed", None)
        state["_packed_key"] = None
        return state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        use = (self.packed_enabled and x.dtype == self.weight.dtype and x.device.type == "cpu"
               and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
               and x.numel() // max(x.shape[-1], 1) <= MAX_PACKED_ROWS)
        if not use:
            return F.linear(x, self.weight, self.bias)
        if weight_key(self.weight) != self._packed_key:
            self._repack(self._batch_hint)   # the weight was replaced or changed in place
        return packed_linear(x, self._packed, self.bias, self._pair_single)


def pack_linears(model: nn.Module, batch_hint: int = BATCH_HINT) -> int:
    """Re-class every CPU bf16 and fp32 nn.Linear of `model` as a PackedLinear; returns how many.

    A no-op (0) for other dtypes and devices, and for bf16 where oneDNN packing is unavailable."""
    n = 0
    for module in model.modules():
        if _packable(module):
            module.__class__ = PackedLinear
            module._repack(batch_hint)
            n += 1
    return n


def is_packed(model: nn.Module) -> bool:
    return any(isinstance(m, PackedLinear) for m in model.modules())


@contextmanager
def packing(model: nn.Module, enabled: bool):
    """Temporarily switch the packed path of `model`'s PackedLinear modules on or off."""
    mods = [m for m in model.modules() if isinstance(m, PackedLinear)]
    before = [m.packed_enabled for m in mods]
    for m in mods:
        m.packed_enabled = enabled
    try:
        yield
    finally:
        for m, b in zip(mods, before):
            m.packed_enabled = b


def kept_or_new(kept, same_source: bool, key, build):
    """The object of a lean path (drafters/lean.py, lean_target.py) for its source as it is now:
    `kept` while it was built from the same source in the same state (`key`), else `build(key)`;
    None where the source cannot take the path (`key` None)."""
    if key is None:
        return None
    if kept is not None and same_source and kept.key == key:
        return kept
    return build(key)


@contextmanager
def lean_off(owner):
    """Temporarily run `owner` (a drafter or a target) on its reference path (`use_lean` off)."""
    before = owner.use_lean
    owner.use_lean = False
    try:
        yield
    finally:
        owner.use_lean = before
