"""Drafters: the DFlash block backbone and the Domino correction head."""
from __future__ import annotations

from .checkpoint import DrafterLoadError, build_drafter, check_fits, load_checkpoint, save_checkpoint
from .dflash import DFlashBackbone, DFlashDrafter, DraftOutput, DrafterConfig, default_target_layer_ids
from .domino import DominoDrafter, DominoHead


def load_drafter(name_or_path, target=None, dtype=None, pack: bool = True):
    """A bundled drafter name, a local checkpoint dir or a Hub id; checked against `target` when given.
    `pack`: pre-packed bf16 linears on CPU (packed.py), as `load_target`."""
    from ..models import resolve_drafter
    drafter = load_checkpoint(resolve_drafter(str(name_or_path)), dtype=dtype, pack=pack)
    if target is not None:
        drafter.check_fits(target)
    return drafter


__all__ = ["DrafterLoadError", "build_drafter", "check_fits", "load_checkpoint", "save_checkpoint",
           "DFlashBackbone", "DFlashDrafter", "DraftOutput", "DrafterConfig", "default_target_layer_ids",
           "DominoDrafter", "DominoHead", "load_drafter"]
