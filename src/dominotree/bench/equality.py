"""The T = 0 losslessness check: identical to plain decoding, or the first divergence is a near-tie.

A parallel forward over many tokens can flip the argmax where the target's top-2 logits are
within floating-point noise (DESIGN.md). At the first position where a method's tokens leave
`ar`'s, a plain forward of the target over prompt + ar[:i] gives the top-2 logit gap there."""
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


def check(target, prompt_ids: list[int], ref: list[int], got: list[int], tie_tol: float) -> dict:
    """{'match': 'exact' | 'tie' | 'diverged', 'index', 'gap', 'expected', 'got'} for one output."""
    i = first_divergence(ref, got)
    if i is None:
        return {"match": "exact"}
    gap = top2_gap(target, prompt_ids, ref[:i])
    return {"match": "tie" if gap <= tie_tol else "diverged", "index": i, "gap": gap,
            "expected": ref[i] if i < len(ref) else None, "got": got[i] if i < len(got) else None}
