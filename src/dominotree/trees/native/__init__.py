"""DominoTree's fast builder compiled (dominotree_builder.cpp), for CPU rounds; the Domino chain
(domino_chain.cpp, wrapped in chain.py) is built into the same library, and both share the head's
per-node steps (head_ops.h).

The Python fast builder (trees/fast.py) spends most of a budget-8 tree in the interpreter: ~25
small tensor calls per batch of expansions at ~4-5 us each, plus the heap. The C++ builder runs
the same heap, the same batches and the same ATen ops on the same shapes, so at the same lookahead
its scores are bit-identical to the Python builder's, and at any lookahead its trees are the
reference builder's.

It is compiled on first use with torch's extension builder (a C++ compiler and ninja, both
offline) into the dominotree cache, keyed by the sources and torch version, and reused after.
Where it cannot be built (no compiler) or `DOMINOTREE_NATIVE=0`, and for the settings it does not
cover (greedy conditioning, the whole vocabulary as candidates, "exact" normalisation, an
embedding module, corr_topm < node_topk), `build_dominotree_native` runs the Python fast builder.
`status()` says which one ran.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from ...extensions import compile_extension, failure_reason
from ..tree import DraftTree
from ..dominotree import ThroughputStop, depth_candidates
from ..fast import HeadWeights, build_dominotree_fast, kept_root_row

HERE = Path(__file__).parent
SOURCES = [HERE / "dominotree_builder.cpp", HERE / "domino_chain.cpp"]
HEADERS = [HERE / "head_ops.h"]
NATIVE_LOOKAHEAD = 4
_state: dict = {"loaded": None, "error": None}    # loaded: None = not tried, True / False


def load() -> bool:
    """Compile (first time) and load the native builder; False, with the reason in status(), if it
    cannot be."""
    if _state["loaded"] is not None:
        return _state["loaded"]
    if os.environ.get("DOMINOTREE_NATIVE", "1") == "0":
        _state.update(loaded=False, error="disabled by DOMINOTREE_NATIVE=0")
        return False
    try:
        compile_extension("dominotree_native", "native", SOURCES, HEADERS, is_python_module=False)
        _state.update(loaded=True, error=None)
    except Exception as exc:   # no compiler, no ninja, a broken toolchain: the Python builder runs
        _state.update(loaded=False, error=failure_reason(exc))
        warnings.warn(f"dominotree: the native tree builder is unavailable ({_state['error']}); "
                      "using the Python fast builder (same trees, slower)", RuntimeWarning, stacklevel=2)
    return _state["loaded"]


def status() -> str:
    """"native" when the compiled builder is loaded, else "fast (<why>)"."""
    if _state["loaded"] is None:
        load()
    return "native" if _state["loaded"] else f"fast ({_state['error']})"


def covers(normalization: str, conditioning: str, corr_topm: int | None, node_topk: int, vocab: int,
           embed, stop) -> bool:
    """The settings the native builder implements (the published ones)."""
    return (normalization == "topm" and conditioning == "path" and corr_topm is not None
            and node_topk <= corr_topm < vocab and isinstance(embed, torch.Tensor)
            and (stop is None or isinstance(stop, ThroughputStop)))


def build_dominotree_native(base_logits: torch.Tensor, hidden: torch.Tensor, head, embed, root_token: int,
                            budget: int, node_topk: int = 8, corr_topm: int | None = 64,
                            normalization: str = "topm", prefix_len: int = 1, max_depth: int | None = None,
                            stop=None, conditioning: str = "path", weights: HeadWeights | None = None,
                            lookahead: int | None = None, vocab_ids: torch.Tensor | None = None) -> DraftTree:
    """build_dominotree_fast's tree (same arguments), built in C++ where it can be. `lookahead`
    (entries expanded per batch; None: each builder's default) is 4 here against the Python
    builder's 32: a batch costs ~4x less here, so expanding fewer entries that are never popped pays
    (budget 8: 0.48 against 0.54 ms per tree; 16: 0.79 against 0.86). The tree is the same for
    every lookahead."""
    kwargs = dict(node_topk=node_topk, corr_topm=corr_topm, normalization=normalization, prefix_len=prefix_len,
                  max_depth=max_depth, stop=stop, conditioning=conditioning, weights=weights, vocab_ids=vocab_ids)
    if lookahead is not None:
        kwargs["lookahead"] = lookahead
    if base_logits.is_cuda or not covers(normalization, conditioning, corr_topm, node_topk,
                                         base_logits.shape[-1], embed, stop) or not load():
        return build_dominotree_fast(base_logits, hidden, head, embed, root_token, budget, **kwargs)
    base_logits, hidden = base_logits.float(), hidden.float()   # compact rows stay compact: covers() holds
    W = weights or HeadWeights(head)
    D = base_logits.shape[0] if max_depth is None else min(max_depth, base_logits.shape[0])
    cands, cand_logits = depth_candidates(base_logits, corr_topm, vocab_ids)
    table = W.table_for(embed)
    costs = torch.tensor(stop.costs(budget + 1) if stop is not None else [], dtype=torch.float64)
    tokens, parents, depths, scores = torch.ops.dominotree_native.build_dominotree(
        base_logits, hidden, cands, cand_logits, W.w1_h, W.s_proj, W.w2, table.table, table.ready, embed,
        W.w_ih, table.block, kept_root_row(W, embed, root_token), int(root_token), int(budget), int(node_topk),
        int(prefix_len), int(D), NATIVE_LOOKAHEAD if lookahead is None else int(lookahead), costs)
    return DraftTree(tokens, parents, depths, scores)
