"""Drafter checkpoints in the published layouts (z-lab DFlash, Domino), and fit checks."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..packed import pack_linears
from .dflash import DFlashBackbone, DFlashDrafter, DrafterConfig
from .domino import DominoDrafter, DominoHead

HEAD_KEYS = ("prefix_gru.", "embed_proj.")


class DrafterLoadError(ValueError):
    """A drafter checkpoint that is missing, corrupt, or does not fit the target."""


def build_drafter(cfg: DrafterConfig, name: str = "drafter"):
    backbone = DFlashBackbone(cfg)
    if cfg.is_domino:
        return DominoDrafter(backbone, DominoHead(cfg), name)
    return DFlashDrafter(backbone, name)


def load_checkpoint(path: Path, dtype: torch.dtype | None = None, name: str | None = None, pack: bool = True):
    path = Path(path)
    raw = read_raw_config(path)
    try:
        cfg = DrafterConfig.from_hf_dict(raw)
    except (KeyError, ValueError, TypeError) as e:
        raise DrafterLoadError(f"{path / 'config.json'}: incomplete drafter config ({e})") from e
    state = read_state(path)
    state = {k.removeprefix("model."): v for k, v in state.items()}
    drafter = build_drafter(cfg, name or path.name)
    _load_state(drafter, state, path / "model.safetensors")
    if dtype is not None:
        drafter.to(dtype=dtype)
    if pack:
        pack_drafter(drafter)
    return drafter


def pack_drafter(drafter) -> None:
    """Pre-pack a drafter's CPU bf16 and fp32 linears (packed.py); a no-op elsewhere."""
    pack_linears(drafter.backbone)
    if hasattr(drafter, "head"):
        pack_linears(drafter.head)


def read_raw_config(path: Path) -> dict:
    """A DFlash/Domino checkpoint directory's config.json as a dict (clear errors for anything else)."""
    cfg_file, weights = path / "config.json", path / "model.safetensors"
    if not cfg_file.is_file():
        raise DrafterLoadError(f"{path}: no config.json (expected a DFlash/Domino checkpoint directory)")
    if not weights.is_file():
        raise DrafterLoadError(f"{path}: no model.safetensors")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise DrafterLoadError(f"{cfg_file}: not valid JSON ({e})") from e
    archs = raw.get("architectures") or []
    if not any(a in ("DFlashDraftModel", "DominoDraftModel") for a in archs):
        raise DrafterLoadError(f"{cfg_file}: architectures {archs} is not DFlashDraftModel/DominoDraftModel")
    return raw


def read_state(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint directory's tensors, as stored."""
    weights = path / "model.safetensors"
    try:
        return load_file(str(weights))
    except (SafetensorError, OSError, RuntimeError) as e:
        raise DrafterLoadError(f"{weights}: corrupt or unreadable safetensors file ({e})") from e


def _load_state(drafter, state: dict, where: Path) -> None:
    modules = {"backbone": drafter.backbone}
    if isinstance(drafter, DominoDrafter):
        modules["head"] = drafter.head
    for key, module in modules.items():
        part = {k: v for k, v in state.items() if k.startswith(HEAD_KEYS) == (key == "head")}
        expected = module.state_dict()
        missing = sorted(set(expected) - set(part))
        unexpected = sorted(set(part) - set(expected))
        if missing or (key == "backbone" and unexpected):
            raise DrafterLoadError(f"{where}: missing tensors {missing[:5]} unexpected {unexpected[:5]}")
        for k, v in expected.items():
            if part[k].shape != v.shape:
                raise DrafterLoadError(f"{where}: {k} has shape {tuple(part[k].shape)}, config implies {tuple(v.shape)}")
        module.load_state_dict({k: part[k].to(v.dtype) for k, v in expected.items()})
        # Keep the checkpoint's dtype (bf16 checkpoints run in bf16).
        module.to(dtype=next(iter(part.values())).dtype)


def save_checkpoint(drafter, path: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous() for k, v in drafter.backbone.state_dict().items()}
    if isinstance(drafter, DominoDrafter):
        state.update({k: v.detach().to(dtype).contiguous() for k, v in drafter.head.state_dict().items()})
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = drafter.config.to_hf_dict()
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


def check_fits(cfg: DrafterConfig, target, backbone=None) -> None:
    """One clear error when a drafter cannot serve this target."""
    problems = []
    if cfg.hidden_size != target.hidden_size:
        problems.append(f"hidden size {cfg.hidden_size} != target's {target.hidden_size}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} beyond the target's {target.num_layers} layers")
    n_emb = target.model.get_input_embeddings().weight.shape[0]
    if not 0 <= cfg.mask_token_id < n_emb:
        problems.append(f"mask_token_id {cfg.mask_token_id} outside the target's embedding of {n_emb} rows")
    if cfg.is_domino and cfg.vocab_size != target.vocab_size:
        problems.append(f"correction head vocabulary {cfg.vocab_size} != target's {target.vocab_size}")
    if problems:
        raise DrafterLoadError("drafter does not fit the target: " + "; ".join(problems))
