"""Drafters: the DFlash block backbone and the Domino correction head."""
from __future__ import annotations

import torch

from ..machine import default_dtype
from .checkpoint import DrafterLoadError, build_drafter, check_fits, load_checkpoint, pack_drafter, save_checkpoint
from .dflash import DFlashBackbone, DFlashDrafter, DraftOutput, DrafterConfig, default_target_layer_ids
from .domino import DominoDrafter, DominoHead


def load_drafter(name_or_path, target=None, dtype=None, pack: bool = True):
    """A bundled drafter name, a local checkpoint dir or a Hub id; checked against `target` when given.
    `dtype`: by default the target's where one is given, else the checkpoint's, except that a bf16
    checkpoint runs in fp32 on an x86 CPU without bf16 hardware, as `load_target` does
    (machine.default_dtype; the upcast is exact).
    `pack`: pre-packed linears on CPU (packed.py), as `load_target`."""
    from ..models import resolve_drafter
    from ..target import DTYPES
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    if dtype is None and target is not None:
        dtype = target.dtype
    drafter = load_checkpoint(resolve_drafter(str(name_or_path)), dtype=dtype, pack=False)
    if dtype is None and drafter.dtype == torch.bfloat16 and default_dtype() == torch.float32:
        drafter.to(dtype=torch.float32)
    if pack:
        pack_drafter(drafter)
    if target is not None:
        drafter.check_fits(target)
    return drafter


__all__ = ["DrafterLoadError", "build_drafter", "check_fits", "load_checkpoint", "save_checkpoint",
           "DFlashBackbone", "DFlashDrafter", "DraftOutput", "DrafterConfig", "default_target_layer_ids",
           "DominoDrafter", "DominoHead", "load_drafter"]
