"""The CUDA-graph builder equals the reference: its per-pop step run eagerly on the CPU (always)
and captured as a graph on a GPU (skipped without CUDA)."""
import pytest
import torch

from dominotree.trees.cuda_graph import CudaGraphDominoBuilder
from dominotree.trees.dominotree import build_dominotree
from test_trees import random_problem

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(30))
def test_cuda_graph_builder_equals_reference(seed, device):
    head, base, hidden, embed = random_problem(seed, V=200, D=8)
    builder = CudaGraphDominoBuilder(head, embed, node_topk=4, corr_topm=16, max_depth=8, device=device)
    with torch.no_grad():
        ref = build_dominotree(base, hidden, head, embed, 5, 24, node_topk=4, corr_topm=16)
        for _ in range(2):      # the first build (which warms up and captures) and a replayed one
            out = builder.build(base, hidden, 5, 24)
            assert torch.equal(ref.tokens, out.tokens.cpu()) and torch.equal(ref.parents, out.parents.cpu())
            assert torch.allclose(ref.scores, out.scores.cpu(), atol=1e-5)


def test_builds_of_other_problems_reuse_the_builder():
    head, base, hidden, embed = random_problem(0, V=200, D=8)
    builder = CudaGraphDominoBuilder(head, embed, node_topk=4, corr_topm=16, max_depth=8, device="cpu")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for root in (5, 17, 60):
            b, h = torch.randn(8, 200, generator=g) * 3, torch.randn(8, hidden.shape[1], generator=g)
            ref = build_dominotree(b, h, head, embed, root, 24, node_topk=4, corr_topm=16)
            out = builder.build(b, h, root, 24)
            assert torch.equal(ref.tokens, out.tokens) and torch.equal(ref.parents, out.parents)


def test_needs_cuda_only_for_a_cuda_device(monkeypatch):
    head, _, _, embed = random_problem(0, V=200, D=8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA device"):
        CudaGraphDominoBuilder(head, embed, device="cuda")
