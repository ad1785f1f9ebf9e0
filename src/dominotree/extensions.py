"""Compile-once loading of the project's C++ extensions (the native tree builder, the tree-verify
attention kernel) with torch's extension builder: a C++ compiler and ninja, both offline.

Each is built into the dominotree cache under a directory keyed by its sources, headers, flags and
the torch version, so an edit or a torch upgrade rebuilds it and everything else reuses the build.
Callers catch the failure (no compiler, no ninja, a compiler without the flags) and fall back to
their Python path; `failure_reason` makes the one-line reason they report.
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Sequence

import torch


def build_dir(subdir: str, sources: Sequence[Path], headers: Sequence[Path] = (),
              flags: Sequence[str] = ()) -> Path:
    from .models import cache_dir
    code = b"".join(Path(f).read_bytes() for f in (*sources, *headers))
    key = hashlib.sha256(code + " ".join(flags).encode() + torch.__version__.encode()).hexdigest()[:16]
    return cache_dir() / subdir / key


def compile_extension(name: str, subdir: str, sources: Sequence[Path], headers: Sequence[Path] = (),
                      cflags: Sequence[str] = ("-O3",), ldflags: Sequence[str] = (),
                      is_python_module: bool = True):
    """Build (first time) and load the extension; raises whatever the build raises."""
    from torch.utils import cpp_extension
    build = build_dir(subdir, sources, headers, [*cflags, *ldflags])
    build.mkdir(parents=True, exist_ok=True)
    if not any(build.glob(f"{name}*.so")):    # a first build takes tens of seconds: say why it waits
        print(f"dominotree: compiling {name} (once, into {build})", file=sys.stderr, flush=True)
    return cpp_extension.load(name=name, sources=[str(f) for f in sources], extra_cflags=list(cflags),
                              extra_ldflags=list(ldflags), build_directory=str(build),
                              is_python_module=is_python_module, verbose=False)


def failure_reason(exc: Exception) -> str:
    """The exception's type and the last line of its message (a build log's last line says why)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[-1].strip() if lines else 'no message'}"
