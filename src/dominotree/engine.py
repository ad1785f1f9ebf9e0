"""The decode loop: prefill, then rounds of draft -> build tree -> verify -> accept -> commit."""
from __future__ import annotations

import os
import threading
import time
import weakref
from dataclasses import dataclass, field, fields

import torch

from .config import ADAPTIVE_METHODS, DRAFT_METHODS, TREE_METHODS, SpecConfig
from .detokenize import MAX_CHAR_TOKENS, REPLACEMENT, stop_prefix_len
from . import tree_attention
from .proposers import make_proposer
from .trees.datastore import SORT_DEPTH, store_for
from .trees.lookup import NgramIndex, merge_branch
from .trees.tree import DraftTree
from .verify import accept, pick_token


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: dict = field(default_factory=dict)


@dataclass
class RoundEvent:
    # tokens emitted this round; the events add up to result.token_ids: with stop strings, a round's
    # last tokens may come in a later event, once they cannot begin one (dt.IncrementalText turns
    # the ids into printable text)
    token_ids: list[int]
    accepted: int          # draft tokens accepted this round (bonus excluded)


class GenerationStream:
    """Iterate to receive each round's new tokens as they commit; `.result` once exhausted."""

    def __init__(self, target, drafter, prompt, cfg: SpecConfig):
        self.target, self.drafter, self.cfg = target, drafter, cfg
        if isinstance(drafter, (str, list, tuple)):
            # generate(target, "Hello", method="ar") reads "Hello" as the drafter
            raise TypeError(f"the drafter argument got a {type(drafter).__name__}: pass the prompt third "
                            "(generate(target, None, prompt, ...)) or as prompt=...; a drafter comes from load_drafter")
        if cfg.method in DRAFT_METHODS and drafter is None:
            raise ValueError(f"method {cfg.method!r} needs a drafter (load one with load_drafter)")
        self.prompt_ids = target.encode_prompt(prompt, raw=cfg.raw)
        if not self.prompt_ids:
            raise ValueError("empty prompt")
        if len(self.prompt_ids) + 1 > target.max_context:
            raise ValueError(f"prompt of {len(self.prompt_ids)} tokens leaves no room in the target's "
                             f"context of {target.max_context} tokens")
        nodes = cfg.max_budget if cfg.method in ADAPTIVE_METHODS else cfg.budget
        if cfg.method in TREE_METHODS and nodes + 1 > target.max_context:
            # one verify attends over every node at once: a bigger tree could only exhaust memory
            raise ValueError(f"a tree of {nodes} nodes besides the root does not fit in one verify within "
                             f"the target's context of {target.max_context} tokens; use a smaller budget")
        if drafter is not None and cfg.method in DRAFT_METHODS:
            drafter.check_fits(target)
        self.proposer = make_proposer(cfg, target, drafter)
        # its first call compiles the kernel (plain decoding's steps use it too): here, not in a timed step
        tree_attention.enabled(target.dtype)
        self.lookup = NgramIndex(cfg.lookup_ngram) if cfg.lookup else None
        self.store = store_for(cfg.lookup_store, target.name) if cfg.lookup_store else None
        self.result: GenerationResult | None = None
        self._rounds = None

    def __iter__(self):
        # one generation per stream: a second loop goes on with the first's live rounds, gets none
        # once they ended, and is refused once they were left early (the generation is gone), never
        # a second generation that replaces .result
        if self._rounds is not None:
            rounds = self._rounds()
            if rounds is not None or self.result is not None:
                return rounds if rounds is not None else iter(())
            raise RuntimeError("this stream's generation was stopped (its loop left or close() called); "
                               "start another with stream_generate(...)")
        rounds = self._iterate()
        self._rounds = weakref.ref(rounds)     # a loop left by `break` still frees (and closes) it
        return rounds

    def close(self) -> None:
        """Stop a generation before it ends, so that the target can start another one."""
        if self._rounds is None:            # closed before it started: it never will
            self._rounds = lambda: None
        rounds = self._rounds()
        if rounds is not None:
            rounds.close()

    def _iterate(self):
        # at the first next(): from here the models' caches are this generation's
        claim = _Claim(self.target, self.drafter if self.cfg.method != "ar" else None)
        try:
            yield from self._run()
        finally:
            self.target.rollback()
            claim.release()

    def _run(self):
        cfg, target, drafter = self.cfg, self.target, self.drafter
        seed = cfg.seed if cfg.seed is not None else int.from_bytes(os.urandom(4), "little")
        gen = torch.Generator().manual_seed(seed)
        eos = target.eos_token_ids
        uses_drafter = cfg.method != "ar"
        stage = {"draft": 0.0, "build": 0.0, "verify": 0.0, "commit": 0.0}
        accepted_per_round, tree_depths, budgets = [], [], []
        lookup_accepted = 0      # accepted tokens that only a lookup branch proposed
        store_accepted = 0       # ... of them, those only the datastore branch proposed
        out: list[int] = []
        finish = None

        t_start = time.perf_counter()
        target.set_taps(drafter.target_layer_ids if uses_drafter else [])
        pre = target.prefill(self.prompt_ids, features=uses_drafter)
        if uses_drafter:
            drafter.reset()
            drafter.add_context(pre.features, start=0)
        root = pick_token(pre.logits[-1], cfg.temperature, cfg.top_k, cfg.top_p, gen)
        prefill_ms = (time.perf_counter() - t_start) * 1e3
        finish, released = self._append(out, [root], eos, 0)
        if self.lookup is not None:
            self.lookup.extend(self.prompt_ids + [root])
        yield RoundEvent(out[:released], 0)

        while finish is None:
            room = target.max_context - target.length - 1   # deepest node the context still holds
            if room < 0:
                finish = "context"
                break
            max_depth = min(room, cfg.max_new_tokens - len(out))
            # The round runs without autograd bookkeeping (a fifth of a DominoTree build's time);
            # the mode is left before the yield, so the caller's code never runs inside it.
            with torch.inference_mode():
                t0 = time.perf_counter()
                tree, timing, info = self.proposer(root, target.length, max_depth)
                n_new = n_store = 0
                if self.lookup is not None:
                    t_l = time.perf_counter()
                    k = min(cfg.lookup, max_depth)
                    half = (len(tree) - 1) // 2            # the branches take at most half the tree
                    branch = self.lookup.lookup(k)
                    tree, n_new = merge_branch(tree, branch, max_new=half)
                    if self.store is not None and half > n_new:
                        tree, n_store = merge_branch(tree, self.store.lookup(
                            self.lookup.tokens[-SORT_DEPTH:], k, cfg.lookup_store_min_n),
                                                     max_new=half - n_new, keep=branch)
                        n_new += n_store
                    timing = {**timing, "build": timing.get("build", 0.0) + (time.perf_counter() - t_l) * 1e3}
                if tree.max_depth > max_depth:
                    tree = tree.truncate_depth(max_depth)
                t1 = time.perf_counter()
                ver = target.verify(tree, features=uses_drafter)
                t2 = time.perf_counter()
                path, bonus = accept(tree, ver.logits, cfg.temperature, cfg.top_k, cfg.top_p, gen)
                target.commit(path)
                if uses_drafter:
                    drafter.add_context(ver.features[path], start=target.length - len(path))
                t3 = time.perf_counter()

            stage["draft"] += timing.get("draft", (t1 - t0) * 1e3)
            stage["build"] += timing.get("build", 0.0)
            stage["verify"] += (t2 - t1) * 1e3
            stage["commit"] += (t3 - t2) * 1e3
            accepted_per_round.append(len(path) - 1)
            lookup_accepted += sum(i >= len(tree) - n_new for i in path[1:])
            store_accepted += sum(i >= len(tree) - n_store for i in path[1:])
            tree_depths.append(tree.max_depth)
            if "budget" in info:
                budgets.append(info["budget"])
            new = tree.tokens[path[1:]].tolist() + [bonus]
            finish, n = self._append(out, new, eos, released)
            if self.lookup is not None:
                self.lookup.extend(new)
            root = bonus
            yield RoundEvent(out[released:n], len(path) - 1)
            released = n

        if finish == "stop_string":       # _append cut the tokens and kept the cut text
            text, finish = self._stop_text, "stop"
        else:
            text = target.decode(out)
        wall = time.perf_counter() - t_start
        rounds = len(accepted_per_round)
        self.result = GenerationResult(text, out, _stats(
            cfg, rounds, accepted_per_round, tree_depths, budgets, stage, prefill_ms, wall, len(out),
            finish, len(self.prompt_ids)))
        if self.lookup is not None:
            self.result.stats["lookup_accepted"] = lookup_accepted
        if self.store is not None:
            self.result.stats["store_accepted"] = store_accepted

    def _append(self, out: list[int], new: list[int], eos: set[int], released: int) -> tuple[str | None, int]:
        """Append a round's tokens up to EOS, the length or a stop string: (the finish reason or
        None, how many of `out` the events may have carried by now; `released` of them went out)."""
        finish = None
        for t in new:
            out.append(t)
            if t in eos:
                finish = "stop"
                break
            if len(out) >= self.cfg.max_new_tokens:
                finish = "length"
                break
        if not self.cfg.stop:
            return finish, len(out)
        # also in the round that reaches EOS or the length: a stop string there is still cut
        start = self._stop_window(out, released)
        text = self.target.decode(out[start:])
        if any(s in text for s in self.cfg.stop):
            # cut here, so that this round's event carries no token past the stop string either
            kept, self._stop_text = self._cut_at_stop(out, self.target.decode(out))
            del out[len(kept):]
            return "stop_string", len(out)
        if finish is not None:
            return finish, len(out)
        return None, self._releasable(out, released, start, text)

    def _stop_window(self, out: list[int], upto: int) -> int:
        """Where a decode starts so that the text before out[upto:] is longer than any stop string:
        a stop string that ends after `upto` begins inside it (however many tokens a round added)."""
        longest = max(map(len, self.cfg.stop)) + MAX_CHAR_TOKENS   # + a character split at the start
        start = upto
        while start > 0 and len(self.target.decode(out[start:upto])) < longest:
            start = max(0, start - longest)
        return start

    def _releasable(self, out: list[int], released: int, start: int, text: str) -> int:
        """All of `out` but the last tokens whose text (`text`, decoded from `start`) could still
        begin a stop string (a character not yet complete included), so that the events add up to
        the result even where a stop string found later spans rounds."""
        bare = text.rstrip(REPLACEMENT)
        held = len(text) - len(bare) + stop_prefix_len(bare, self.cfg.stop, len(bare))
        n = len(out)
        while held and n > released and len(self.target.decode(out[start:n])) > len(text) - held:
            n -= 1
        return n

    def _cut_at_stop(self, out, text):
        cut = min((text.find(s) for s in self.cfg.stop if s in text), default=-1)
        if cut < 0:
            return out, text
        text = text[:cut]
        for n in range(len(out) + 1):   # the shortest token prefix that covers the kept text
            if len(self.target.decode(out[:n])) >= cut:
                return out[:n], text
        return out, text


def acceptance_survival(accepted: list[int], depth: int) -> list[float]:
    """P(at least d draft tokens accepted) over all rounds, d = 1..depth: non-increasing, sums to tau - 1."""
    if not accepted:
        return []
    return [sum(a >= d for a in accepted) / len(accepted) for d in range(1, depth + 1)]


class _Claim:
    """A target (and drafter) keeps one generation's cache: a second generation started while a
    first is still open would overwrite it and corrupt both, so it is refused instead."""

    _lock = threading.Lock()      # two threads must not both find the models free

    def __init__(self, *models):
        self.models = [m for m in models if m is not None]
        with self._lock:
            if any(getattr(m, "_generation", None) is not None for m in self.models):
                raise RuntimeError("this target or drafter is in the middle of another generation (a stream "
                                   "not yet exhausted, or another thread's); finish or close() it first, "
                                   "or load a second copy")
            for m in self.models:
                m._generation = self

    def release(self) -> None:
        for m in self.models:
            if getattr(m, "_generation", None) is self:
                m._generation = None


def _stats(cfg, rounds, acc, depths, budgets, stage, prefill_ms, wall, n_out, finish, n_prompt) -> dict:
    per_pos = acceptance_survival(acc, max(depths, default=0))
    stats = {
        "method": cfg.method,
        "tau": (sum(acc) + rounds) / rounds if rounds else 1.0,
        "rounds": rounds,
        "accepted_per_round": acc,
        "per_position_acceptance": per_pos,
        "new_tokens": n_out,
        "prompt_tokens": n_prompt,
        "wall_s": wall,
        "tokens_per_second": n_out / wall if wall > 0 else 0.0,
        "prefill_ms": prefill_ms,
        "stage_ms": {k: (v / rounds if rounds else 0.0) for k, v in stage.items()},
        "finish_reason": finish,
    }
    if budgets:
        stats["budgets"] = budgets
    return stats


def generate(target, drafter=None, prompt="", method: str | None = None, config: SpecConfig | None = None,
             **options) -> GenerationResult:
    """Generate from `prompt` (a string, chat messages, or token ids) with a speculative `method`
    (default "dominotree"). `config`: a SpecConfig to start from; `method` and `options` override it."""
    stream = GenerationStream(target, drafter, prompt, _config(method, config, options))
    for _ in stream:
        pass
    return stream.result


def stream_generate(target, drafter=None, prompt="", method: str | None = None, config: SpecConfig | None = None,
                    **options) -> GenerationStream:
    """Like generate, but iterate the returned stream for per-round RoundEvents."""
    return GenerationStream(target, drafter, prompt, _config(method, config, options))


def _config(method: str | None, config: SpecConfig | None, options: dict) -> SpecConfig:
    if config is not None and not isinstance(config, SpecConfig):
        raise TypeError(f"config must be a dominotree.SpecConfig, got {type(config).__name__}")
    base = {} if config is None else {f.name: getattr(config, f.name) for f in fields(SpecConfig)}
    base = {k: list(v) if isinstance(v, list) else v for k, v in base.items()}   # the caller's stays theirs
    if method is not None:
        options = {**options, "method": method}
    return SpecConfig.from_kwargs(**{**base, **options})     # checked again: an override may not fit


__all__ = ["GenerationResult", "GenerationStream", "RoundEvent", "generate", "stream_generate", "DraftTree"]
