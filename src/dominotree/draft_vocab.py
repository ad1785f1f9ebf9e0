"""A reduced draft vocabulary: the drafter's LM head scores only the tokens the target writes most.

A DFlash drafter has no LM head of its own: it reuses the target's, a [V, h] matrix (49,152 x 576
for SmolLM2, 57 MB in bf16) that a draft reads once per round for a handful of rows. On a CPU that
read is memory-bound and costs about as much as the drafter's layers. Scoring only the N tokens the
target writes most often (the frequency-ranked draft vocabulary of FR-Spec; EAGLE-3's `d2t` map is
the same idea) reads N / V of it. The draft keeps those logits compact, [D, N]: the tree builders
scan N columns instead of V (their top-k and normalisers), and whatever reads vocabulary-wide rows
sees -inf on every other token, so no chain or tree drafts it. Verification is unchanged, so the
output is the target's as with any draft (greedy: its tokens, up to the floating-point near-ties a
different tree's verify batch can tip); a token left out only costs acceptance where the target
writes it, and the lookup branches still propose any token. The ranking comes from the target's
own training responses (`train-data`, as the datastore branch's) or any directory of training
shards.
"""
from __future__ import annotations

import weakref
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from .packed import pack_linears, weight_key
from .trees.datastore import SEP, resolve_store, shard_responses


@lru_cache(maxsize=4)
def token_ranking(data_dir: str, vocab_size: int) -> np.ndarray:
    """Token ids by how often the responses of a shard directory hold them (ties: the smaller id)."""
    tokens = shard_responses(Path(data_dir))
    tokens = tokens[tokens != SEP]
    if len(tokens) and int(tokens.max()) >= vocab_size:
        raise ValueError(f"the training shards in {data_dir} hold token id {int(tokens.max())}, beyond the "
                         f"target's vocabulary of {vocab_size}: they were written by another tokenizer")
    return rank_by_count(tokens, vocab_size)


def rank_by_count(tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    """Token ids by how often `tokens` holds them, most first; ties: the smaller id."""
    return np.argsort(-np.bincount(tokens, minlength=vocab_size), kind="stable")


def top_token_ids(ranking: np.ndarray, n: int, always=()) -> torch.Tensor:
    """The n first ids of a ranking plus the ids in `always` (end-of-turn tokens), sorted."""
    ids = set(ranking[:n].tolist()) | {int(t) for t in always}
    return torch.tensor(sorted(ids), dtype=torch.long)


def widen(compact: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[n, vocab_size] rows holding compact [n, N] scores at columns `ids`, -inf elsewhere."""
    out = torch.full((compact.shape[0], vocab_size), float("-inf"), device=compact.device)
    return out.index_copy_(1, ids, compact)


class DraftVocab:
    """The LM-head rows of a token subset, packed like the target's own linears."""

    def __init__(self, lm_head: nn.Linear, ids: torch.Tensor):
        self.ids = ids.to(lm_head.weight.device)
        self.vocab_size = lm_head.weight.shape[0]
        w = lm_head.weight.detach()
        self.head = nn.Linear(w.shape[1], len(ids), bias=lm_head.bias is not None,
                              dtype=w.dtype, device=w.device).requires_grad_(False)
        with torch.no_grad():
            self.head.weight.copy_(w[self.ids])
            if lm_head.bias is not None:
                self.head.bias.copy_(lm_head.bias.detach()[self.ids])
        pack_linears(self.head)    # a no-op unless bf16 on a CPU with oneDNN packing

    def __len__(self) -> int:
        return len(self.ids)

    def compact(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [n, N] of the subset's tokens (column j scores token ids[j])."""
        return self.head(hidden).float()

    def expand(self, compact: torch.Tensor) -> torch.Tensor:
        """Vocabulary-wide logits [n, V] from compact ones: the subset's scores, -inf elsewhere."""
        return widen(compact, self.ids, self.vocab_size)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [n, V] for hidden rows [n, h]: the subset's scores, -inf elsewhere."""
        return self.expand(self.compact(hidden))


_cache: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()   # per LM-head module


def draft_vocab_for(target, n: int, source: str = "train-data") -> DraftVocab:
    """The `n`-token draft vocabulary of a target, ranked on the responses `source` names
    ("train-data": the target's committed training shards; otherwise a shard directory). Built once
    per target weight, size and source."""
    lm_head = target.model.get_output_embeddings()
    vocab = lm_head.weight.shape[0]
    if not isinstance(n, int) or not 1 <= n <= vocab:
        raise ValueError(f"draft_vocab must be an integer in 1..{vocab} (the target's vocabulary), got {n!r}")
    path = str(resolve_store(source, target.name, option="draft_vocab_source"))
    per_weight = _cache.setdefault(lm_head, {})
    key = (n, path, weight_key(lm_head.weight))   # rebuilt if the weight is changed in place
    if key not in per_weight:
        ids = top_token_ids(token_ranking(path, vocab), n, target.eos_token_ids)
        per_weight[key] = DraftVocab(lm_head, ids)
    return per_weight[key]
