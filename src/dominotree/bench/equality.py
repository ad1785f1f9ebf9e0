"""The T = 0 losslessness check: identical to plain decoding, or the first divergence is a near-tie.

A parallel forward over many tokens can flip the argmax where the target's top-2 logits are
within floating-point noise (DESIGN.md). At the first position where a method's tokens leave
`ar`'s, a plain forward of the target over prompt + ar[:i] gives the top-2 logit gap there. That
forward is a third computation besides the two that parted: where its gap exceeds the tolerance,
the gap plain decoding's own steps saw (prompt, then one token at a time, as `ar` ran) decides, so
a bf16 near-tie that drifted over many tokens is not mistaken for a lossy method (measured: a full
forward's 0.625 where the steps had 0.25, token 88 of a 96-token answer). Where that gap exceeds it
too, a third opinion: the smallest gap the target's own verifies give there, chains of 1, 2, 4, 8
and 16 tokens ending at that position after a prefill of the rest (a tree verify is such a
multi-token forward; measured: a logit of ~36, where bf16's spacing is 0.25, moved by 0.5 with the
chain length, and a 16-node DDTree verify chose the other token of a pair 0.5 apart in plain
decoding's steps). A lossy method still fails: its divergences are not at gaps of a few bf16 ulps."""
from __future__ import annotations

import torch


def gap_of(logits: torch.Tensor) -> float:
    """top1 - top2 of one row of logits."""
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


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
    return gap_of(target.model(input_ids=ids).logits[0, -1])


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
    return gap_of(logits)


CHAINS = (1, 2, 4, 8, 16)


@torch.inference_mode()
def chain_gap(target, prompt_ids: list[int], prefix: list[int], chains=CHAINS) -> float:
    """The smallest top1 - top2 gap of the next-token logits after prompt + prefix over verifies of
    the prefix's last k tokens (k in `chains`) after a prefill of the rest, as tree rounds compute it."""
    from ..trees.tree import DraftTree
    seq = list(prompt_ids) + list(prefix)
    target.set_taps([])
    gaps = []
    try:
        for k in (k for k in chains if k <= len(prefix)):
            target.reset()
            target.prefill(seq[:len(seq) - k], features=False)
            chain = seq[len(seq) - k:]
            logits = target.verify(DraftTree.from_lists(chain, list(range(-1, k - 1))), features=False).logits[-1]
            gaps.append(gap_of(logits))
    finally:
        target.reset()
    return min(gaps, default=float("inf"))


def check(target, prompt_ids: list[int], ref: list[int], got: list[int], tie_tol: float) -> dict:
    """{'match': 'exact' | 'tie' | 'diverged', 'index', 'gap', 'expected', 'got'} for one output,
    plus 'step_gap' (see step_gap) where the plain forward's gap exceeds the tolerance, and
    'chain_gap' (see chain_gap) where that one does too."""
    i = first_divergence(ref, got)
    if i is None:
        return {"match": "exact"}
    gap = top2_gap(target, prompt_ids, ref[:i])
    out = {"match": "tie", "index": i, "gap": gap,
           "expected": ref[i] if i < len(ref) else None, "got": got[i] if i < len(got) else None}
    decisive = gap
    for name, opinion in (("step_gap", step_gap), ("chain_gap", chain_gap)):   # asked only while over
        if decisive <= tie_tol:
            break
        decisive = out[name] = opinion(target, prompt_ids, ref[:i])
    out["match"] = "tie" if decisive <= tie_tol else "diverged"
    return out


def opinions_note(e: dict) -> str:
    """The later opinions of an equality record as a parenthetical ('' when the first decided)."""
    parts = ([f"{e['step_gap']:.4g} in plain decoding's own steps"] if "step_gap" in e else []) + \
            ([f"{e['chain_gap']:.4g} at least in verifies of 1-16 tokens ending there"] if "chain_gap" in e else [])
    return f" ({', '.join(parts)})" if parts else ""
