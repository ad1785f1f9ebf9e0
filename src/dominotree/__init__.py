"""dominotree: lossless speculative decoding with DFlash drafters, Domino heads and draft trees."""
from .config import METHODS, SpecConfig
from .detokenize import IncrementalText
from .engine import GenerationResult, GenerationStream, RoundEvent, generate, stream_generate
from .models import ModelNotFoundError, list_models
from .target import TargetModel, load_target
from .trees.tree import DraftTree


def load_drafter(name_or_path, target=None, **kwargs):
    """A DFlash or Domino drafter from a bundled name, a local checkpoint directory or a Hub id."""
    from .drafters import load_drafter as _load
    return _load(name_or_path, target=target, **kwargs)


__all__ = ["METHODS", "SpecConfig", "IncrementalText", "GenerationResult", "GenerationStream", "RoundEvent",
           "generate", "stream_generate", "ModelNotFoundError", "list_models", "TargetModel", "load_target",
           "load_drafter", "DraftTree"]
__version__ = "0.1.0"
