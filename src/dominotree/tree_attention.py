"""Attention on AVX-512 for tree verifies and one-token steps: bf16 on CPUs with the bf16
dot-product instruction but no AMX, fp32 on any AVX-512F CPU.

A tree verify attends 16-72 query rows (a tree's nodes times the query heads folded onto each
key/value head, gqa_attention.py) to a few hundred cached keys. On an AVX-512 BF16 CPU without AMX
(this project's 2-core EPYC) torch's flash kernel computes those bf16 products at fp32 speed, and
the attention is what grows most when a verify grows: at 470 cached keys it took a 16-node verify's
30 layers from 1.1 to 4.6 ms. `tree_attention.cpp` runs both products on vdpbf16ps (exact bf16
products, fp32 sums) with an fp32 softmax, rounding only the softmax numerators to bf16 for the
value product, as GPU flash kernels do: 1.6-2x faster than SDPA at 16-72 rows, with the same error
against a float64 reference (tests/test_tree_attention.py). Where the models run in fp32 (an x86
CPU without bf16 hardware, machine.default_dtype) its fp32 kernel runs both products as fp32 FMAs:
torch's kernel spent ~200 us on each 48-row block of a 16-node SmolLM2 verify there (6 ms of ~60).

Each row runs over the keys it sees, in key order, closed up over the keys its mask rules out: a
node's row (the context, then its ancestors) is computed exactly as a one-token step of that node
once its path is in the cache. One-token steps run on the kernel too (at 100-1000 cached keys it is
also 1.4-2.3x faster there than SDPA), so a verify's row and plain decoding's step of the same token
give the same bits, and with row-consistent linears (packed.py, fp32_linear.py) greedy speculative
decoding gives plain decoding's tokens exactly (`TargetModel.exact_steps`). Before the fifty-fourth
session the steps ran on SDPA and 19 of 24 benchmark answers (128 tokens, DominoTree) parted from
plain decoding at a near-tie; now none do.

It serves masked query blocks of more than one row and unmasked one-token steps (`grouped_sdpa`,
the target's lean path and module path alike, so the two stay bit-identical); prompts and the
drafter's unmasked blocks keep SDPA. It is compiled on first use into the dominotree cache (a C++
compiler and ninja; with -mavx512bf16 where the CPU has it, else the fp32 kernel alone) and used by
default in bf16 where the CPU reports avx512_bf16 and no amx_bf16 (on AMX CPUs torch's kernel runs
on AMX tiles, which were not measured against it), in fp32 wherever it reports avx512f.
`DOMINOTREE_TREE_ATTENTION=0` turns it off, `=1` turns it on wherever the CPU can run it;
`reference_attention()` switches it off for a block of code (the reference: SDPA).
"""
from __future__ import annotations

import math
import os
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from .extensions import compile_extension, failure_reason

SOURCE = Path(__file__).with_name("tree_attention.cpp")
HEAD_SIZES = (16, 32, 64, 128)
FP32_FLAGS = ["-O3", "-mavx512f", "-mfma", "-fopenmp"]
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-fopenmp"]
KERNEL_DTYPES = (torch.bfloat16, torch.float32)
_state: dict = {"module": None, "error": None, "tried": False, "enabled": None, "wanted": {}}


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_runs(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this CPU can run the kernel for `dtype` at all."""
    return dtype in KERNEL_DTYPES and ("avx512_bf16" if dtype == torch.bfloat16 else "avx512f") in cpu_flags()


def wanted(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this process should use the kernel for `dtype`: the env switch, else the CPU (bf16:
    avx512_bf16 without AMX; fp32: avx512f)."""
    env = os.environ.get("DOMINOTREE_TREE_ATTENTION", "auto").strip().lower()
    if env in ("0", "false", "off") or not cpu_runs(dtype):
        return False
    return env in ("1", "true", "on") or dtype != torch.bfloat16 or "amx_bf16" not in cpu_flags()


def _load():
    if not _state["tried"]:
        _state["tried"] = True
        try:
            flags = FLAGS if cpu_runs(torch.bfloat16) else FP32_FLAGS   # an Ice Lake: no -mavx512bf16 code
            _state["module"] = compile_extension("dominotree_tree_attention", "tree_attention", [SOURCE],
                                                 cflags=flags, ldflags=["-fopenmp"])
        except Exception as exc:   # no compiler, no ninja, an old one without -mavx512bf16: SDPA runs
            _state["error"] = failure_reason(exc)
            warnings.warn(f"dominotree: the tree attention kernel is unavailable ({_state['error']}); "
                          "tree verifies use SDPA (same outputs up to rounding, slower)", RuntimeWarning, stacklevel=3)
    return _state["module"]


def enabled(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether `dtype` query blocks go to the kernel now (it is compiled on the first call that is)."""
    switched = _state["enabled"]
    if switched is None:    # the environment and the CPU, read once per dtype: this runs every step
        if dtype not in _state["wanted"]:
            _state["wanted"][dtype] = wanted(dtype)
        on = _state["wanted"][dtype]
    else:
        on = switched and cpu_runs(dtype)
    return on and _load() is not None and (dtype != torch.bfloat16 or _state["module"].has_bf16())


def status(dtype: torch.dtype = torch.bfloat16) -> str:
    """"on", or "off (<why>)", for a benchmark's run.json (for the target's dtype)."""
    if enabled(dtype):
        return "on"
    if _state["error"]:
        return f"off ({_state['error']})"
    if dtype == torch.float32 and not cpu_runs(dtype):
        return "off (needs avx512f)"
    if dtype == torch.bfloat16 and not (cpu_runs(dtype) and ("amx_bf16" not in cpu_flags() or wanted(dtype))):
        return "off (needs avx512_bf16 without amx_bf16, or DOMINOTREE_TREE_ATTENTION=1)"
    return "off (switched off)" if dtype in KERNEL_DTYPES else "off (bf16 and fp32 only)"


@contextmanager
def _switched(on: bool):
    before = _state["enabled"]
    _state["enabled"] = on
    try:
        yield
    finally:
        _state["enabled"] = before


def reference_attention():
    """Run tree verifies and one-token steps on SDPA inside this block (an A/B, or the reference in tests)."""
    return _switched(False)


def kernel_attention():
    """Use the kernel inside this block wherever the CPU can run it (tests on AMX CPUs)."""
    return _switched(True)


def applies(q: torch.Tensor, k: torch.Tensor, mask, tokens: int) -> bool:
    """bf16 or fp32 CPU query rows of one sequence for `tokens` positions, a head size the kernel
    has, and either a mask it reads as it is ([1, 1, rows, keys], additive) over several positions
    (a tree verify) or no mask for one position (a one-token step: each row sees every key)."""
    if mask is None:
        shaped = tokens == 1
    else:
        shaped = (tokens > 1 and mask.dim() == 4 and mask.shape[:2] == (1, 1)
                  and mask.shape[2] == q.shape[2] and mask.shape[3] == k.shape[2]
                  and mask.dtype in (torch.bfloat16, torch.float32))
    return (shaped and q.device.type == "cpu" and q.dtype in KERNEL_DTYPES and k.dtype == q.dtype
            and q.dim() == 4 and q.shape[0] == 1 and q.shape[-1] in HEAD_SIZES and enabled(q.dtype))


def attention(q, k, v, mask, scale=None) -> torch.Tensor:
    """SDPA of q [1, H, R, D] on k, v [1, H, L, D] under the additive mask [1, 1, R, L] (or None: every
    row sees every key) -> [1, H, R, D] in q's dtype. Call where `applies` holds."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if mask is not None:
        mask = mask[0, 0] if q.dtype == torch.bfloat16 else mask[0, 0].float()   # fp32 rows: an fp32 mask
    out = _state["module"].tree_attention(q[0].contiguous(), k[0].contiguous(), v[0].contiguous(),
                                          None if mask is None else mask.contiguous(), scale)
    return out[None]
