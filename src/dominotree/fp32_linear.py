"""fp32 linear products for decoding steps and tree verifies on AVX-512 CPUs, from bf16-stored weights.

On an x86 CPU without bf16 hardware the models run in fp32 (machine.default_dtype), and there
neither library product suits the 1-128 rows of a step or a verify: MKL's `F.linear` is slow for
a few rows, its product on a column-major copy is better but still streams 4 bytes per weight,
and oneDNN's bf16 product converts at fp32 speed. `fp32_linear.cpp` keeps the weight in blocks of
16 outputs and adds each k's term into 16 rows' registers at once. A bf16 checkpoint run in fp32
(the embedded target, the bundled drafters) has only bf16 values in its fp32 weights, so the
blocks hold them in bf16, exactly: half the bytes of an fp32 copy, the same numbers.

Each output is its sum over k in k order, whatever the rows around it: a row alone gives the bits
it gets among others (tests/test_fp32_linear.py). The sums are not MKL's, so the logits equal
transformers' fp32 forward up to fp32 rounding.

Compiled on first use (a C++ compiler and ninja); used by `packed.pack_weight` for fp32 weights on
CPUs with AVX-512F. `DOMINOTREE_FP32_LINEAR=0` keeps the column-major MKL copy.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from .extensions import compile_extension, failure_reason
from .machine import cpu_facts

SOURCE = Path(__file__).with_name("fp32_linear.cpp")
FLAGS = ["-O3", "-mavx512f", "-mfma", "-fopenmp"]   # -fopenmp: at::parallel_for is serial without it
_state: dict = {"module": None, "error": None, "tried": False}


class Blocked:
    """A packed fp32 weight: `blocks` [ceil(out / 16), in, 16] in bf16 (when exact) or fp32.
    `shape` and `dtype` are the weight's ([out, in], float32), as for the other packed weights."""

    dtype = torch.float32

    def __init__(self, blocks: torch.Tensor, shape: torch.Size):
        self.blocks, self.shape = blocks, torch.Size(shape)

    @property
    def stored_in_bf16(self) -> bool:
        return self.blocks.dtype == torch.bfloat16


def wanted() -> bool:
    env = os.environ.get("DOMINOTREE_FP32_LINEAR", "auto").strip().lower()
    return env not in ("0", "false", "off") and "avx512f" in cpu_facts()[1]


def _load():
    if not _state["tried"]:
        _state["tried"] = True
        try:
            _state["module"] = compile_extension("dominotree_fp32_linear", "fp32_linear", [SOURCE], cflags=FLAGS,
                                                 ldflags=["-fopenmp"])
        except Exception as exc:   # no compiler or ninja: the column-major MKL copy runs
            _state["error"] = failure_reason(exc)
            warnings.warn(f"dominotree: the fp32 linear kernel is unavailable ({_state['error']}); "
                          "fp32 products run on MKL (same outputs up to rounding, slower)", RuntimeWarning,
                          stacklevel=3)
    return _state["module"]


def available() -> bool:
    """Whether fp32 weights get packed for the kernel here (compiled on the first call that asks)."""
    return wanted() and _load() is not None


def status() -> str:
    """"on", or "off (<why>)", for a benchmark's run.json."""
    if available():
        return "on"
    if _state["error"]:
        return f"off ({_state['error']})"
    return "off (switched off)" if "avx512f" in cpu_facts()[1] else "off (needs AVX-512F)"


def pack(w: torch.Tensor) -> Blocked:
    """w [out, in] fp32 on CPU -> its blocks, in bf16 where that loses nothing."""
    w = w.detach()
    if w.dtype != torch.float32 or w.dim() != 2 or w.device.type != "cpu":
        raise ValueError("fp32_linear.pack takes a 2-D fp32 CPU weight")
    exact = torch.equal(w.bfloat16().float(), w)
    return Blocked(_load().pack(w.bfloat16() if exact else w.contiguous()), w.shape)


def linear(x: torch.Tensor, packed: Blocked, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for fp32 x [..., in] on the weight's blocks."""
    out_features, in_features = packed.shape
    lead = x.shape[:-1]
    y = _load().linear(x.reshape(-1, in_features).contiguous(), packed.blocks, out_features)
    if bias is not None:
        y.add_(bias)
    return y.view(*lead, out_features)
