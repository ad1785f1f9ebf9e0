"""The T = 0 losslessness check: identical to plain decoding, or the first divergence is a near-tie.

A parallel forward over many tokens can flip the argmax where the target's top-2 logits are
within floating-point noise (DESIGN.md). At the first position where a method's tokens leave
`ar`'s, a plain forward of the target over prompt + ar[:i] gives the top-2 logit gap there. That
forward is a third computation besides the two that parted: where its gap exceeds the tolerance,
the gap plain decoding's own steps saw (prompt, then one token at a time, as `ar` ran) decides, so
a bf16 near-tie that drifted over many tokens is not mistaken for a lossy method (measured: a full
forward's 0.625 where the steps had 0.25, token 88 of a 96-token answer)."""
from __future__ import annotations

import torch


def first_divergence(ref: list[int], got: list[int]) -> int | None:
    """Index of the first differing token (a length mismatch counts at the shorter end), or None."""
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            return i
    return None if len(ref) == len(got) else min(len(ref), len(got))


@torch.inference_mode()
def top2_gap(target, prompt_ids: list[int], prefix: list[int]) -> float:
    """top1 - top2 of the target's next-token logits after prompt + prefix (one plain forward)."""
    ids = torch.tensor([list(prompt_ids) + list(prefix)], device=target.device)
    logits = target.model(input_ids=ids).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


@torch.inference_mode()
def step_gap(target, prompt_ids: list[int], prefix: list[int]) -> float:
    """top1 - top2 of the next-token logits as plain decoding computed them: the prompt prefilled,
    then `prefix` fed one token per step (the engine's `ar` path, the target's fast paths included)."""
    from ..trees.tree import DraftTree
    target.set_taps([])
    logits = target.prefill(list(prompt_ids), features=False).logits[-1]
    try:
        for token in prefix:
            logits = target.verify(DraftTree.single(int(token)), features=False).logits[0]
            target.commit([0])
    finally:
        target.rollback()
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def check(target, prompt_ids: list[int], ref: list[int], got: list[int], tie_tol: float) -> dict:
    """{'match': 'exact' | 'tie' | 'diverged', 'index', 'gap', 'expected', 'got'} for one output,
    plus 'step_gap' (see step_gap) where the plain forward's gap exceeds the tolerance."""
    i = first_divergence(ref, got)
    if i is None:
        return {"match": "exact"}
    gap = top2_gap(target, prompt_ids, ref[:i])
    out = {"match": "tie", "index": i, "gap": gap,
           "expected": ref[i] if i < len(ref) else None, "got": got[i] if i < len(got) else None}
    if gap > tie_tol:
        out["step_gap"] = step_gap(target, prompt_ids, ref[:i])
        out["match"] = "tie" if out["step_gap"] <= tie_tol else "diverged"
    return out
