"""topk_rows: the blocked two-pass top-k returns torch.topk's values and indices that point at them."""
import pytest
import torch

from dominotree.trees.topk import topk_rows


def _check(x, k, block=64):
    values, indices = topk_rows(x, k, block)
    ref = torch.topk(x, min(k, x.shape[-1]), dim=-1)
    assert torch.equal(values, ref.values)                      # same values, descending
    assert torch.equal(x.gather(-1, indices), values)           # the indices point at them
    assert all(len(set(r)) == len(r) for r in indices.reshape(-1, indices.shape[-1]).tolist())
    return indices, ref.indices


@pytest.mark.parametrize("k", [1, 8, 16, 64])
def test_distinct_values_give_torch_topk_exactly(k):
    g = torch.Generator().manual_seed(k)
    x = torch.randperm(16 * 8192, generator=g).float().reshape(16, 8192) if k == 1 else \
        torch.stack([torch.randperm(32768, generator=g).float() for _ in range(5)])
    indices, ref = _check(x, k)
    assert torch.equal(indices, ref)


def test_many_ties_and_clustered_maxima():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 6, (7, 16384), generator=g).float()   # every value tied thousands of times
    _check(x, 64)
    y = torch.full((3, 16384), -5.0)
    y[0, 64 * 10: 64 * 11] = torch.arange(64).float()          # all of the top-k inside one block
    y[1, -20:] = 7.0                                            # at the row's end, tied
    y[2, :: 997] = torch.linspace(0, 1, len(y[2, :: 997]))      # one winner per block, spread out
    _check(y, 64)
    _check(torch.full((2, 8192), float("-inf")), 16)            # nothing finite


def test_one_dimensional_and_fallback_shapes():
    g = torch.Generator().manual_seed(1)
    _check(torch.randn(49152, generator=g), 8)                  # [V]
    _check(torch.randn(4, 1000, generator=g), 8)                # not a whole number of blocks
    _check(torch.randn(4, 512, generator=g), 64)                # short row: torch.topk itself
    _check(torch.randn(2, 40, generator=g), 64)                 # k > V clips to V


def test_negative_control_a_wrong_block_choice_is_caught():
    """The check above is not vacuous: picking blocks by their first entry instead of their max
    misses top values."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 16384, generator=g)
    blocks = x.reshape(4, -1, 64)
    wrong = torch.topk(blocks[..., 0], 16, dim=-1).indices
    picked = torch.gather(blocks, 1, wrong[..., None].expand(4, 16, 64)).reshape(4, -1)
    assert not torch.equal(torch.topk(picked, 16, dim=-1).values, torch.topk(x, 16, dim=-1).values)
