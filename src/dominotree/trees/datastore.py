"""A datastore branch: drafts copied from text the target wrote before (REST-style retrieval).

The context lookup (lookup.py) copies only from the prompt and the answer so far. A small target's
greedy answers to other prompts repeat its own phrasing ("Here is the Python function", "Let's
break it down step by step"), so the project's training data, which the target wrote and whose
prompts are disjoint from every benchmark prompt, is a second place to copy from. The store is a
suffix array over those responses, sorted by their first `SORT_DEPTH` tokens; a lookup finds the
longest suffix of the context (down to `min_n` tokens) that occurs in it and follows the
continuation most of the occurrences agree on, token by token. The engine's default `min_n` is 4
(`lookup_store_min_n`): with 2, the short matches' branches displaced better drafter nodes (GSM tau
3.50 -> 3.22 at budget 8; docs/RESULTS.md). Verification is unchanged, so the branch only decides
which tokens the target gets to check."""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from functools import lru_cache
from pathlib import Path

import numpy as np

SEP = -1              # between responses: no continuation crosses it
SORT_DEPTH = 8        # suffixes are ordered by this many tokens: the longest n-gram a lookup matches
MAX_VOTERS = 4096     # occurrences that vote on a continuation (an even sample of a larger range)


class Datastore:
    def __init__(self, tokens: np.ndarray):
        self.tokens = np.asarray(tokens, dtype=np.int32)       # responses, SEP after each
        self._padded = np.concatenate([self.tokens, np.full(SORT_DEPTH + 1, SEP, np.int32)])
        self.suffixes = self._sort_suffixes()

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_sequences(cls, sequences) -> "Datastore":
        """From token sequences (lists or arrays of ids), each one response."""
        parts = []
        for s in sequences:
            parts += [np.asarray(s, dtype=np.int32), np.array([SEP], np.int32)]
        return cls(np.concatenate(parts) if parts else np.zeros(0, np.int32))

    def _sort_suffixes(self) -> np.ndarray:
        n = len(self.tokens)
        keys = [self._padded[j:j + n] for j in range(SORT_DEPTH - 1, -1, -1)]   # last key sorts first
        return np.lexsort(keys).astype(np.int32) if n else np.zeros(0, np.int32)

    def _range(self, gram: tuple[int, ...]) -> tuple[int, int]:
        """Suffix-array rows whose suffix starts with `gram`."""
        n, pad = len(gram), self._padded
        key = lambda p: tuple(pad[p:p + n].tolist())      # noqa: E731
        lo = bisect_left(self.suffixes, gram, key=key)
        return lo, bisect_right(self.suffixes, gram, lo=lo, key=key)

    def lookup(self, context, k: int, min_n: int = 4) -> list[int]:
        """Up to k tokens: the majority continuation of the longest suffix of `context` (of at least
        `min_n` tokens) that occurs in the store."""
        if not 1 <= min_n <= SORT_DEPTH:
            raise ValueError(f"min_n must be in 1..{SORT_DEPTH}, got {min_n}")
        context = [int(t) for t in context]
        for n in range(min(SORT_DEPTH, len(context)), min_n - 1, -1):
            lo, hi = self._range(tuple(context[-n:]))
            if hi > lo:
                step = -(-(hi - lo) // MAX_VOTERS)
                return _majority_path(self._padded, self.suffixes[lo:hi:step].astype(np.int64) + n, k)
        return []


def _majority_path(padded: np.ndarray, starts: np.ndarray, k: int) -> list[int]:
    """Follow, token by token, the continuation most voters share (ties: the smaller id)."""
    out: list[int] = []
    for d in range(k):
        nxt = padded[starts + d]
        live = nxt != SEP
        if not live.any():
            break
        vals, counts = np.unique(nxt[live], return_counts=True)
        best = int(vals[counts.argmax()])
        out.append(best)
        starts = starts[nxt == best]
    return out


def lookup_reference(sequences, context, k: int, min_n: int = 4) -> list[int]:
    """Datastore.lookup by a plain scan of every position (the reference the suffix array is tested against)."""
    context = [int(t) for t in context]
    flat: list[int] = []
    for s in sequences:
        flat += [int(t) for t in s] + [SEP]
    for n in range(min(SORT_DEPTH, len(context)), min_n - 1, -1):
        suffix = context[-n:]
        starts = [p + n for p in range(len(flat) - n + 1) if flat[p:p + n] == suffix]
        if starts:
            out: list[int] = []
            for d in range(k):
                votes: dict[int, int] = {}
                for p in starts:
                    t = flat[p + d] if p + d < len(flat) else SEP
                    if t != SEP:
                        votes[t] = votes.get(t, 0) + 1
                if not votes:
                    break
                best = min(votes, key=lambda t: (-votes[t], t))
                out.append(best)
                starts = [p for p in starts if p + d < len(flat) and flat[p + d] == best]
            return out
    return []


# -- the store of a model's training responses ------------------------------------------------

def shard_responses(data_dir: Path) -> np.ndarray:
    """Every response of a directory of training shards (train/data.py's format), SEP-separated."""
    from ..train.data import shard_paths
    paths = shard_paths(data_dir)
    if not paths:
        raise FileNotFoundError(f"no training shards (shard_*.npz) in {data_dir}")
    sep, parts = np.array([SEP], np.int32), []
    for path in paths:
        with np.load(path) as z:
            tokens, off, plen = z["tokens"].astype(np.int32), z["offsets"], z["prompt_lens"]
        for i in range(len(plen)):
            parts += [tokens[off[i] + plen[i]:off[i + 1]], sep]
    return np.concatenate(parts)


def resolve_store(spec: str, target_name: str | None = None, option: str = "lookup_store") -> Path:
    """`train-data`: the committed training shards of the target; otherwise a directory of shards.
    `option` names the setting in the errors (lookup_store, draft_vocab_source)."""
    if spec == "train-data":
        from ..train.data import seed_dir_for
        if not target_name:
            raise ValueError(f"{option} 'train-data' needs the target's name")
        path = seed_dir_for(target_name)
        if not path.is_dir():
            raise FileNotFoundError(f"no committed training data for {target_name!r} at {path}; "
                                    f"give {option} a directory of training shards")
        return path
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"{option} {spec!r} is not a directory of training shards")
    return path


@lru_cache(maxsize=4)
def load_store(data_dir: str) -> Datastore:
    """The datastore of a shard directory, built once per process (~2 s for 4.5M tokens)."""
    return Datastore(shard_responses(Path(data_dir)))


def store_for(spec: str, target_name: str | None) -> Datastore:
    """The datastore a `lookup_store` option names (see resolve_store), built or cached."""
    return load_store(str(resolve_store(spec, target_name)))
