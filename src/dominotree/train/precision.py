"""Which matmul precision trains fastest on this CPU.

bf16 is ~2x fp32 where the CPU has AMX (Intel's matrix unit); without it bf16 matmuls are slower
than fp32 ones (measured on AVX-512 cores without AMX: a DFlash step 1.77 vs 1.2 s, the feature
pass ~500 vs ~770 tokens/s; docs/TRAINING.md). `auto` picks by the CPU's flags."""
from __future__ import annotations

from pathlib import Path

from ..machine import CPUINFO, has_amx

CHOICES = ("auto", "bf16", "fp32")


def resolve_precision(name: str, cpuinfo: Path = CPUINFO) -> str:
    if name not in CHOICES:
        raise ValueError(f"precision must be one of {', '.join(CHOICES)}, got {name!r}")
    if name != "auto":
        return name
    return "bf16" if has_amx(cpuinfo) else "fp32"
