"""GPU check: the CUDA-graph DominoTree builder returns the reference builder's trees; timings.

Run on a machine with CUDA:  python scripts/check_cuda_builder.py [--problems 200]
Prints identity counts (the first build, which captures the graph, and a replayed one), the max
score difference and median build ms (reference on CPU, CUDA graph)."""
import argparse
import statistics
import time

import torch

from dominotree.drafters import DominoHead, DrafterConfig
from dominotree.trees.cuda_graph import CudaGraphDominoBuilder
from dominotree.trees.dominotree import build_dominotree


def problem(seed, V=49152, D=16, h=576, G=256, r=128):
    g = torch.Generator().manual_seed(seed)
    cfg = DrafterConfig(hidden_size=h, num_hidden_layers=1, num_attention_heads=9, num_key_value_heads=3,
                        head_dim=64, intermediate_size=1536, vocab_size=V, num_target_layers=30,
                        target_layer_ids=[1, 14, 27], mask_token_id=16, projector_type="domino", emb_dim=r,
                        gru_hidden_dim=G, shift_label=True)
    head = DominoHead(cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.05, generator=g)
    return head, torch.randn(D, V, generator=g) * 3, torch.randn(D, h, generator=g), torch.randn(V, h, generator=g)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--problems", type=int, default=100)
    ap.add_argument("--budget", type=int, default=16)
    a = ap.parse_args()
    same, diff, worst, t_ref, t_gpu = 0, 0, 0.0, [], []
    for seed in range(a.problems):
        head, base, hidden, embed = problem(seed)
        builder = CudaGraphDominoBuilder(head, embed, node_topk=8, corr_topm=64)
        with torch.inference_mode():
            t0 = time.perf_counter()
            ref = build_dominotree(base, hidden, head, embed, 5, a.budget, node_topk=8, corr_topm=64)
            t_ref.append((time.perf_counter() - t0) * 1e3)
            first = builder.build(base, hidden, 5, a.budget)     # warm-up and capture, outside the timing
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = builder.build(base, hidden, 5, a.budget)
            torch.cuda.synchronize()
            t_gpu.append((time.perf_counter() - t0) * 1e3)
        if all(torch.equal(ref.tokens, o.tokens) and torch.equal(ref.parents, o.parents) for o in (first, out)):
            same += 1
            worst = max(worst, max(float((ref.scores - o.scores).abs().max()) for o in (first, out)))
        else:
            diff += 1
    print(f"identical trees: {same}/{a.problems} (different: {diff}); max |score diff| {worst:.2e}")
    print(f"median build ms: reference (CPU) {statistics.median(t_ref):.2f}, CUDA graph {statistics.median(t_gpu):.2f}")
    raise SystemExit(0 if diff == 0 else 1)


if __name__ == "__main__":
    main()
