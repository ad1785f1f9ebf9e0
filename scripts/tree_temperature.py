"""Probe: held-out tau when the tree scores use the draft logits times beta (a tree-scoring temperature).

    python scripts/tree_temperature.py --betas 0.5,0.7,0.85,1,1.5,2,3 --temperatures 0,0.5

Budget-8 DDTree and DominoTree with the prompt-lookup branch and draft_vocab=8192 on the benchmark
prompts (8 per dataset). beta scales the base logits and the Domino head's correction, so both
builders score log-softmax(beta * logits): beta > 1 sharpens (deeper trees), beta < 1 flattens.
Verification is untouched, so every output stays lossless; only tau moves (docs/RESULTS.md).
"""
import argparse
import copy
import statistics

import dominotree as dt
from dominotree.bench.datasets import load_dataset


def scaled(drafter, beta: dict):
    """Patch the drafter so that its drafts and its tree weights are scaled by beta["value"]."""
    inner, plain, kept = drafter.draft, drafter.tree_weights(), {}

    def draft(root, start, target, **kw):
        out = inner(root, start, target, **kw)
        logits, ids = out.scores()
        if beta["value"] != 1.0:
            out = type(out)(out.hidden, logits * beta["value"]) if ids is None else \
                type(out)(out.hidden, vocab=out.vocab, vocab_logits=logits * beta["value"])
        return out

    def tree_weights():
        b = beta["value"]
        if b not in kept:
            kept[b] = copy.copy(plain)
            kept[b].w2 = plain.w2 * b          # the correction W2 z, scaled with the base logits
        return kept[b]

    drafter.draft, drafter.tree_weights = draft, tree_weights


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--betas", default="0.5,1,2")
    ap.add_argument("--temperatures", default="0")
    ap.add_argument("--max-samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    target, drafter = dt.load_target("smollm2-135m"), dt.load_drafter("smollm2-135m-domino")
    prompts = [p.text for ds in ("mt-bench", "humaneval", "gsm") for p in load_dataset(ds)[:args.max_samples]]
    beta = {"value": 1.0}
    scaled(drafter, beta)
    for T in map(float, args.temperatures.split(",")):
        for method in ("ddtree", "dominotree"):
            for b in map(float, args.betas.split(",")):
                beta["value"] = b
                taus = [dt.generate(target, drafter, p, method=method, budget=8, lookup=8, draft_vocab=8192,
                                    max_new_tokens=args.max_new_tokens, temperature=T, seed=i).stats["tau"]
                        for i, p in enumerate(prompts)]
                print(f"T={T} {method} beta={b} tau={statistics.fmean(taus):.3f}", flush=True)


if __name__ == "__main__":
    main()
