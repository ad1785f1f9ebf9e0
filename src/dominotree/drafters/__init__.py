"""Drafters: the DFlash block backbone and the Domino correction head."""
from __future__ import annotations

from .checkpoint import DrafterLoadError, build_drafter, check_fits, load_checkpoint, save_checkpoint
from .dflash import DFlashBackbone, DFlashDrafter, DraftOutput, DrafterConfig, default_target_layer_ids
from .domino import DominoDrafter, DominoHead


def load_drafter(name_or_path, target=None, dtype=None):
    """A bundled drafter name or a local checkpoint dir; checked against `target` when given."""
    from ..models import resolve_drafter
    drafter = load_checkpoint(resolve_drafter(str(name_or_path)), dtype=dtype)
    if target is not None:
        drafter.check_fits(target)
    return drafter


__all__ = ["DrafterLoadError", "build_drafter", "check_fits", "load_checkpoint", "save_checkpoint",
           "DFlashBackbone", "DFlashDrafter", "DraftOutput", "DrafterConfig", "default_target_layer_ids",
           "DominoDrafter", "DominoHead", "load_drafter"]
