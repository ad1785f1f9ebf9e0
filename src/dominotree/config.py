"""SpecConfig: every knob of a generation call in one place, validated once; and the checks of the
flag values (lists, output paths) that the CLI commands share."""
from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from .trees.datastore import SORT_DEPTH

METHODS = ("ar", "dflash", "domino", "ddtree", "caddtree", "dominotree", "condadaptive")
TREE_METHODS = ("ddtree", "caddtree", "dominotree", "condadaptive")
ADAPTIVE_METHODS = ("caddtree", "condadaptive")   # choose their budget with a cost model, up to max_budget
DRAFT_METHODS = METHODS[1:]
INT_FIELDS = ("max_new_tokens", "top_k", "budget", "max_budget", "node_topk", "lookup", "lookup_ngram",
              "lookup_store_min_n", "draft_vocab")
OPTIONAL_INT_FIELDS = ("max_depth", "corr_topm", "seed")


@dataclass
class SpecConfig:
    method: str = "dominotree"
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = 0
    stop: list[str] = field(default_factory=list)
    raw: bool = False                  # raw text prompt: no chat template
    budget: int = 16                   # tree nodes besides the root
    max_depth: int | None = None       # default: the drafter's block depth
    node_topk: int = 8                 # DominoTree children per expansion
    corr_topm: int | None = 64         # DominoTree candidates per depth (None: whole vocabulary)
    normalization: str = "topm"        # "topm" (published) or "exact"
    conditioning: str = "path"         # DominoTree ladder: "path" | "greedy" (correction once per depth)
    builder: str = "native"            # "native" (C++; "fast" where it cannot run), "fast" or "reference"
    cost_model: str | None = None      # JSON from `dominotree profile` (caddtree, condadaptive)
    max_budget: int = 64               # cap for the adaptive methods
    lookup: int = 0                    # prompt-lookup branch of up to this many tokens per tree (0: off)
    lookup_ngram: int = 3              # longest context suffix the lookup matches (down to 1 token)
    lookup_store: str | None = None    # also a branch copied from text the target wrote before:
                                       # "train-data" (its committed training responses) or a shard dir
    lookup_store_min_n: int = 4        # shortest context suffix the datastore matches (up to SORT_DEPTH, 8)
    draft_vocab: int = 0               # the drafter scores only the N tokens the target writes most (0: all)
    draft_vocab_source: str = "train-data"   # responses that rank them: "train-data" or a shard dir

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        self._check_types()
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.budget < 1:
            raise ValueError(f"budget must be an integer >= 1, got {self.budget!r}")
        if self.max_depth is not None and self.max_depth < 1:
            raise ValueError(f"max_depth must be an integer >= 1 or None (the drafter's depth), got {self.max_depth!r}")
        if self.max_budget < 1:
            raise ValueError(f"max_budget must be an integer >= 1, got {self.max_budget!r}")
        if self.node_topk < 1:
            raise ValueError(f"node_topk must be >= 1, got {self.node_topk}")
        if self.corr_topm is not None and self.corr_topm < 1:
            raise ValueError(f"corr_topm must be >= 1 or None, got {self.corr_topm}")
        if self.normalization not in ("topm", "exact"):
            raise ValueError(f"normalization must be 'topm' or 'exact', got {self.normalization!r}")
        if self.conditioning not in ("path", "greedy"):
            raise ValueError(f"conditioning must be 'path' or 'greedy', got {self.conditioning!r}")
        if self.builder not in ("native", "fast", "reference"):
            raise ValueError(f"builder must be 'native', 'fast' or 'reference', got {self.builder!r}")
        if self.lookup < 0:
            raise ValueError(f"lookup must be an integer >= 0, got {self.lookup!r}")
        if self.lookup and self.method == "ar":
            raise ValueError("lookup adds a branch to a draft tree; method 'ar' has none (use a draft method)")
        if self.lookup_ngram < 1:
            raise ValueError(f"lookup_ngram must be an integer >= 1, got {self.lookup_ngram!r}")
        if self.lookup_store is not None and not self.lookup:
            raise ValueError("lookup_store adds a second lookup branch; it needs lookup=N > 0 (the branch length)")
        if not 1 <= self.lookup_store_min_n <= SORT_DEPTH:
            raise ValueError(f"lookup_store_min_n must be an integer in 1..{SORT_DEPTH}, got {self.lookup_store_min_n!r}")
        if self.draft_vocab < 0:
            raise ValueError(f"draft_vocab must be an integer >= 0 (0: the whole vocabulary), got {self.draft_vocab!r}")
        if self.draft_vocab and self.method == "ar":
            raise ValueError("draft_vocab restricts a drafter's LM head; method 'ar' drafts nothing")
        widest = max(self.node_topk, self.corr_topm or 0)
        if self.draft_vocab and self.draft_vocab < widest:
            raise ValueError(f"draft_vocab={self.draft_vocab} is smaller than the {widest} candidates a depth "
                             "offers (node_topk, corr_topm); use a larger draft_vocab or 0")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(x, str) and x for x in self.stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        if self.seed is not None and not -2 ** 63 <= self.seed < 2 ** 63:
            raise ValueError(f"seed must be an integer in [-2**63, 2**63) or None, got {self.seed!r}")

    def _check_types(self) -> None:
        """Types first (numpy integers become ints): a bool budget or a 2.5 top_k used to pass the
        range checks below and reach the builders."""
        for name in INT_FIELDS + OPTIONAL_INT_FIELDS:
            v = getattr(self, name)
            if v is None and name in OPTIONAL_INT_FIELDS:
                continue
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise ValueError(f"{name} must be an integer{' or None' if name in OPTIONAL_INT_FIELDS else ''}, "
                                 f"got {v!r}")
            setattr(self, name, int(v))
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise ValueError(f"{name} must be a number, got {v!r}")
            setattr(self, name, float(v))
        if not isinstance(self.raw, bool):
            raise ValueError(f"raw must be True or False, got {self.raw!r}")
        for name in ("cost_model", "lookup_store"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, (str, os.PathLike)):
                raise ValueError(f"{name} must be a path (or None), got {v!r}")
        if not isinstance(self.draft_vocab_source, (str, os.PathLike)):
            raise ValueError(f"draft_vocab_source must be 'train-data' or a path, got {self.draft_vocab_source!r}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "SpecConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown generation option(s): {', '.join(unknown)}")
        return cls(**kwargs)


# Flag values the CLI commands share, checked before a model loads: a long run must not end in a
# traceback because its output path was unusable.

def check_int(name: str, value, low: int) -> None:
    """A ValueError unless `value` is an integer (not a bool) >= low."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def int_list(text: str, flag: str) -> list[int]:
    """A comma-separated flag value as integers, or a ValueError that names the flag."""
    try:
        return [int(x) for x in str(text).split(",")]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None


def output_dir(path, flag: str) -> Path:
    """`path` made (parents too) as a directory, or a ValueError that names the flag."""
    path = Path(path)
    blocker = next((a for a in (path, *path.parents) if a.exists() and not a.is_dir()), None)
    if blocker is not None:
        raise ValueError(f"{flag} {path}: {blocker} is a file, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot make this directory ({e.strerror or e})") from None
    return path


def output_file(path, flag: str) -> Path:
    """`path` checked writable as a file (its directory made), or a ValueError that names the flag."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory; give a file name")
    output_dir(path.parent, flag)
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"{flag} {path}: not writable")
    return path
