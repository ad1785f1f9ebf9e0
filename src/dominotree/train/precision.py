"""Which matmul precision runs a training stage fastest on this CPU.

CPUs of one kind differ here. With AMX (Intel's matrix unit) bf16 is ~2x fp32. Without it, it
depends on the core: on a Xeon with AVX-512 bf16 but no AMX, bf16 was slower (a DFlash step 1.77
vs 1.2 s), while on an AMD EPYC with the same flags it is twice as fast (a 5-layer DFlash step
1.26 vs 2.53 s; the feature pass ~2,000 vs ~570 tokens/s; docs/TRAINING.md). So `auto` takes bf16
where the CPU has AMX, and elsewhere times one bf16 and one fp32 matrix product of a training
step's shape and takes bf16 only if it is clearly faster."""
from __future__ import annotations

import functools
import time
from pathlib import Path

import torch

from ..machine import CPUINFO, has_amx

CHOICES = ("auto", "bf16", "fp32")
MARGIN = 1.2     # bf16 must be this much faster: a near draw keeps fp32's exact arithmetic


@functools.lru_cache(maxsize=1)
def bf16_speedup(rows: int = 1536, width: int = 576, reps: int = 5) -> float:
    """fp32 time / bf16 time of a [rows, width] x [width, 4 width] product (a step's MLP shape),
    medians of `reps` after a warm-up: > 1 where bf16 is faster on this CPU."""
    def median_time(dtype) -> float:
        x = torch.randn(rows, width).to(dtype)
        w = torch.randn(4 * width, width).to(dtype)
        torch.nn.functional.linear(x, w)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, w)
            times.append(time.perf_counter() - t0)
        return sorted(times)[reps // 2]
    return median_time(torch.float32) / median_time(torch.bfloat16)


def resolve_precision(name: str, cpuinfo: Path = CPUINFO, speedup=bf16_speedup) -> str:
    """`name`, or for "auto" the faster one here: bf16 with AMX, else bf16 only if `speedup()`
    (measured on this CPU) is at least MARGIN."""
    if name not in CHOICES:
        raise ValueError(f"precision must be one of {', '.join(CHOICES)}, got {name!r}")
    if name != "auto":
        return name
    if has_amx(cpuinfo):
        return "bf16"
    return "bf16" if speedup() >= MARGIN else "fp32"
