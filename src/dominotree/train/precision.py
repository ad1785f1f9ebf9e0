"""Which matmul precision runs a training stage fastest on this CPU.

Training (bf16 autocast over plain fp32 weights) is ~2x faster in bf16 where the CPU has AMX
(Intel's matrix unit) and slower without it (AVX-512 cores without AMX: a DFlash step 1.77 vs
1.2 s; docs/TRAINING.md). The feature pass is inference: its bf16 target runs the pre-packed
linears (packed.py), which are fast wherever the CPU has bf16 dot products, AMX or AVX-512 bf16
(a 2-core AMD EPYC without AMX: ~2,000 vs ~570 tokens/s in fp32). `auto` picks by the CPU's flags."""
from __future__ import annotations

from pathlib import Path

from ..machine import CPUINFO, cpu_facts, has_amx

CHOICES = ("auto", "bf16", "fp32")


def resolve_precision(name: str, cpuinfo: Path = CPUINFO, inference: bool = False) -> str:
    """`name`, or for "auto" the faster one here: for training (`inference=False`) bf16 only with
    AMX; for an inference pass of the packed target, bf16 with AMX or AVX-512 bf16."""
    if name not in CHOICES:
        raise ValueError(f"precision must be one of {', '.join(CHOICES)}, got {name!r}")
    if name != "auto":
        return name
    if inference:
        return "bf16" if cpu_facts(cpuinfo)[1] & {"amx_bf16", "avx512_bf16"} else "fp32"
    return "bf16" if has_amx(cpuinfo) else "fp32"
