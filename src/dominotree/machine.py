"""What machine a measurement ran on: speedups here depend on the CPU's matrix units.

A tree verify of 17 tokens costs ~1.3x a one-token step on a CPU with AMX (Intel's matrix
unit) and ~1.35-1.8x without it (docs/RESULTS.md), so every benchmark run records these facts."""
from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

CPUINFO = Path("/proc/cpuinfo")
MATRIX_FLAGS = ("amx_bf16", "avx512_bf16", "avx512f")   # from fastest bf16 matmuls down


def cpu_facts(cpuinfo: Path = CPUINFO) -> tuple[str, set[str]]:
    """(model name, flags) of the first CPU in /proc/cpuinfo; ('', empty) where it cannot be read."""
    try:
        text = cpuinfo.read_text()
    except OSError:     # not Linux: no way to tell
        return "", set()
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return model, flags


def has_amx(cpuinfo: Path = CPUINFO) -> bool:
    return "amx_bf16" in cpu_facts(cpuinfo)[1]


NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def native_bf16(cpuinfo: Path = CPUINFO) -> bool | None:
    """Whether this x86 CPU multiplies bf16 in hardware (AMX or AVX-512 BF16); None where its flags
    cannot be read (not Linux, or an ARM CPU, whose /proc/cpuinfo has "Features", not "flags")."""
    flags = cpu_facts(cpuinfo)[1]
    if not flags:
        return None
    return any(f in flags for f in NATIVE_BF16_FLAGS)


def default_dtype(device: str | torch.device = "cpu", cpuinfo: Path = CPUINFO) -> torch.dtype:
    """The dtype models run in unless told: bf16, except on an x86 CPU without bf16 hardware, where
    oneDNN converts every bf16 product to fp32 and fp32 weights are faster: a 16-token verify of the
    embedded target took 77 ms in fp32 against 172 ms in bf16 on a 2-core Ice Lake Xeon
    (docs/RESULTS.md, "fp32 on CPUs without native bf16"). A rule on CPU flags, not a timing, so the
    choice (and with it the greedy output) is the same on every run of a machine."""
    if torch.device(device).type != "cpu":
        return torch.bfloat16
    return torch.float32 if native_bf16(cpuinfo) is False else torch.bfloat16


def machine_info(cpuinfo: Path = CPUINFO) -> dict:
    model, flags = cpu_facts(cpuinfo)
    info = {"cpu": model or platform.processor() or platform.machine(),
            "cpu_flags": [f for f in MATRIX_FLAGS if f in flags],
            "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def describe(info: dict) -> str:
    """One line for a report, e.g. 'AMD EPYC, 2 cores (2 torch threads), avx512_bf16 avx512f, no AMX, torch 2.13.0'."""
    flags = info.get("cpu_flags", [])
    parts = [f"{info.get('cpu') or '?'}, {info.get('cores')} cores ({info.get('torch_threads')} torch threads)",
             " ".join(f for f in flags if f != "amx_bf16") or "no AVX-512",
             "AMX" if "amx_bf16" in flags else "no AMX", f"torch {info.get('torch')}"]
    if info.get("gpu"):
        parts.append(info["gpu"])
    return ", ".join(parts)
