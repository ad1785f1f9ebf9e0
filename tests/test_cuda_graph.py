"""The CUDA-graph builder equals the reference (GPU only; skipped without CUDA)."""
import pytest
import torch

from dominotree.trees.dominotree import build_dominotree
from test_trees import random_problem

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)


@pytest.mark.parametrize("seed", range(30))
def test_cuda_graph_builder_equals_reference(seed):
    from dominotree.trees.cuda_graph import CudaGraphDominoBuilder
    head, base, hidden, embed = random_problem(seed, V=200, D=8)
    builder = CudaGraphDominoBuilder(head, embed, node_topk=4, corr_topm=16, max_depth=8)
    with torch.no_grad():
        ref = build_dominotree(base, hidden, head, embed, 5, 24, node_topk=4, corr_topm=16)
        out = builder.build(base, hidden, 5, 24)
    assert torch.equal(ref.tokens, out.tokens) and torch.equal(ref.parents, out.parents)
    assert torch.allclose(ref.scores, out.scores, atol=1e-5)
