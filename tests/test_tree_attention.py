"""The tree-attention kernels (bf16, and fp32 on any AVX-512F CPU): SDPA's accuracy against float64,
rows computed on their own and bit-identical to one-token steps over the keys they see, masked keys
ignored exactly, used by tree verifies and one-token steps, lossless decoding, a clear switch."""
import pytest
import torch
import torch.nn.functional as F

import dominotree as dt
import dominotree.tree_attention as ta
from conftest import random_drafter
from dominotree.gqa_attention import grouped_sdpa
from dominotree.trees.tree import DraftTree

needs_kernel = pytest.mark.skipif("avx512_bf16" not in ta.cpu_flags(), reason="the CPU has no avx512_bf16")
needs_fp32_kernel = pytest.mark.skipif("avx512f" not in ta.cpu_flags(), reason="the CPU has no avx512f")
MIN = torch.finfo(torch.bfloat16).min


@pytest.fixture
def kernel():
    with ta.kernel_attention():
        if not ta.enabled():
            pytest.skip(f"the kernel did not build: {ta.status()}")
        yield ta._state["module"]


@pytest.fixture
def kernel32():
    with ta.kernel_attention():
        if not ta.enabled(torch.float32):
            pytest.skip(f"the kernel did not build: {ta.status(torch.float32)}")
        yield ta._state["module"]


def tree_mask(rows: int, keys: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """An additive mask [1, 1, rows, keys]: random visible keys (the first always) per row."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.rand(rows, keys, generator=g) > 0.4
    allowed[:, 0] = True                      # every row sees the first context token
    return torch.zeros(1, 1, rows, keys, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)


def qkv(heads, rows, keys, d, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, n, d, generator=g).mul(s).to(dtype) for n, s in ((rows, 1.0), (keys, 2.0), (keys, 1.0))]


def errors(q, k, v, mask, out):
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask.double())
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return (out.double() - exact).abs().max().item(), (sdpa.double() - exact).abs().max().item()


@needs_kernel
@pytest.mark.parametrize("d", ta.HEAD_SIZES)
@pytest.mark.parametrize("rows,keys", [(2, 1), (3, 5), (8, 16), (9, 17), (17, 100), (72, 470)])
def test_as_accurate_as_sdpa_against_float64(kernel, d, rows, keys):
    q, k, v = qkv(3, rows, keys, d, seed=rows * 1000 + keys + d)
    mask = tree_mask(rows, keys, seed=keys)
    out = ta.attention(q, k, v, mask)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    ours, sdpa = errors(q, k, v, mask, out)
    # the output's own bf16 rounding dominates both: ours within 1.5x SDPA's (+ one bf16 step of slack)
    assert ours <= 1.5 * sdpa + 8e-3, (ours, sdpa)


@needs_kernel
def test_a_fp32_mask_and_a_scale_are_honoured(kernel):
    q, k, v = qkv(2, 6, 40, 64, seed=3)
    mask = tree_mask(6, 40, seed=4, dtype=torch.float32)
    out = ta.attention(q, k, v, mask, scale=0.3)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask.double(), scale=0.3)
    assert (out.double() - exact).abs().max() < 2e-2


@needs_kernel
def test_negative_control_a_wrong_mask_is_far_off(kernel):
    """The accuracy bound above catches a mask read the wrong way round (rows reversed)."""
    q, k, v = qkv(3, 16, 200, 64, seed=5)
    mask = tree_mask(16, 200, seed=6)
    ours, sdpa = errors(q, k, v, mask, ta.attention(q, k, v, mask.flip(2)))
    assert ours > 10 * (1.5 * sdpa + 8e-3)


@needs_kernel
def test_each_row_is_computed_on_its_own(kernel):
    """A row's output does not depend on which other rows share the call (bit for bit)."""
    q, k, v = qkv(3, 19, 130, 64, seed=7)
    mask = tree_mask(19, 130, seed=8)
    whole = ta.attention(q, k, v, mask)
    for rows in ([0, 1], [5, 11, 18], list(range(9, 19))):
        part = ta.attention(q[:, :, rows].contiguous(), k, v, mask[:, :, rows].contiguous())
        assert torch.equal(part, whole[:, :, rows])


@needs_kernel
def test_masked_keys_after_the_context_change_nothing(kernel):
    """Keys every row masks (e.g. other tree branches) contribute exactly zero, whatever their values."""
    q, k, v = qkv(3, 8, 50, 64, seed=9)
    mask = tree_mask(8, 50, seed=10)
    extra = torch.full((1, 3, 23, 64), 30.0, dtype=torch.bfloat16)
    k2, v2 = torch.cat([k, extra], 2), torch.cat([v, -extra], 2)
    mask2 = torch.cat([mask, torch.full((1, 1, 8, 23), MIN, dtype=torch.bfloat16)], 3)
    assert torch.equal(ta.attention(q, k2, v2, mask2), ta.attention(q, k, v, mask))


@needs_kernel
def test_bad_calls_raise_instead_of_reading_out_of_bounds(kernel):
    q, k, v = qkv(2, 4, 10, 64, seed=11)
    mask = tree_mask(4, 10, seed=12)[0, 0]
    with pytest.raises(RuntimeError, match="mask"):
        kernel.tree_attention(q[0], k[0], v[0], mask[:, :9].contiguous(), 0.125)
    with pytest.raises(RuntimeError, match="head size"):
        kernel.tree_attention(q[0, :, :, :48].contiguous(), k[0, :, :, :48].contiguous(), v[0, :, :, :48].contiguous(), mask, 0.125)
    with pytest.raises(RuntimeError, match="bf16"):
        kernel.tree_attention(q[0].float(), k[0], v[0], mask, 0.125)
    with pytest.raises(RuntimeError, match="heads"):
        kernel.tree_attention(q[0, :1].contiguous(), k[0], v[0], mask, 0.125)


def test_tree_verifies_and_one_token_steps_apply(monkeypatch):
    monkeypatch.setattr(ta, "enabled", lambda dtype=torch.bfloat16: True)
    q, k, _ = qkv(2, 6, 30, 64, seed=13)
    mask = tree_mask(6, 30, seed=14)
    assert ta.applies(q, k, mask, 6)                                  # a tree verify
    assert ta.applies(q[:, :, :3], k, None, 1)                        # a one-token step (3 heads folded)
    assert not ta.applies(q, k, None, 6)                              # the drafter's unmasked blocks
    assert not ta.applies(q[:, :, :1], k, mask[:, :, :1], 1)          # a masked one-token block
    assert ta.applies(q.float(), k.float(), mask, 6)                  # fp32 models: the fp32 kernel
    assert not ta.applies(q.half(), k.half(), mask, 6)                # no fp16 kernel
    assert not ta.applies(q.float(), k, mask, 6)                      # mixed dtypes
    assert not ta.applies(q[..., :48], k[..., :48], mask, 6)          # a head size the kernel lacks
    assert not ta.applies(q, k, mask[:, :, :, :29], 6)                # a mask that does not fit
    assert not ta.applies(q, k, mask.bool(), 6)                       # a boolean mask
    monkeypatch.setattr(ta, "enabled", lambda dtype=torch.bfloat16: False)
    assert not ta.applies(q, k, mask, 6)
    assert not ta.applies(q[:, :, :3], k, None, 1)


@needs_kernel
@pytest.mark.parametrize("d", ta.HEAD_SIZES)
@pytest.mark.parametrize("context", [1, 15, 16, 47, 300])
def test_a_tree_row_is_a_one_token_step_over_the_keys_it_sees(kernel, d, context):
    """Bit for bit: a node's row in a tree verify (the context, then its ancestors among the tree's
    keys) equals a one-token step that sees the context and the node's path as contiguous keys, as
    plain decoding's cache holds them; with 3 query heads folded per key/value head."""
    rows_equal_steps(d, context, torch.bfloat16)


def rows_equal_steps(d, context, dtype):
    """Checks every node's rows against its one-token step; returns (tree, q, k, v, verify output)."""
    g = torch.Generator().manual_seed(context * 7 + d)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, 21)]
    tree = DraftTree.from_lists(list(range(21)), parents)
    n, groups = len(tree), 3
    q, k, v = qkv(2, groups * n, context + n, d, seed=context + d, dtype=dtype)
    allowed = torch.cat([torch.ones(n, context, dtype=torch.bool), tree.ancestor_mask()], 1).repeat(groups, 1)
    mask = torch.zeros(1, 1, groups * n, context + n, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    out = ta.attention(q, k, v, mask)
    for i in range(n):
        keys = list(range(context)) + [context + a for a in tree.path(i)]
        rows = [gi * n + i for gi in range(groups)]
        step = ta.attention(q[:, :, rows].contiguous(), k[:, :, keys].contiguous(), v[:, :, keys].contiguous(), None)
        assert torch.equal(step, out[:, :, rows]), (i, tree.path(i))
    return tree, q, k, v, out


@needs_kernel
def test_negative_control_another_attention_shows_in_the_bits(kernel):
    """The bit-for-bit test above can fail: a one-token step on SDPA (fp32 numerators) is within
    rounding of the kernel's, not equal to it."""
    q, k, v = qkv(6, 1, 200, 64, seed=21)          # 6 query heads of one token on 2 key/value heads
    k, v = k[:, :2].contiguous(), v[:, :2].contiguous()
    ours = grouped_sdpa(q, k, v, None)
    with ta.reference_attention():
        sdpa = grouped_sdpa(q, k, v, None)
    assert not torch.equal(ours, sdpa) and (ours.float() - sdpa.float()).abs().max() < 2e-2


def test_the_cpu_and_the_environment_decide(monkeypatch):
    monkeypatch.delenv("DOMINOTREE_TREE_ATTENTION", raising=False)
    monkeypatch.setattr(ta, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    assert ta.wanted()
    monkeypatch.setattr(ta, "cpu_flags", lambda: {"avx512f", "avx512_bf16", "amx_bf16"})
    assert not ta.wanted()                       # AMX: torch's own kernel, not measured against it
    monkeypatch.setenv("DOMINOTREE_TREE_ATTENTION", "1")
    assert ta.wanted()
    monkeypatch.setenv("DOMINOTREE_TREE_ATTENTION", "0")
    assert not ta.wanted()
    monkeypatch.setenv("DOMINOTREE_TREE_ATTENTION", "1")
    monkeypatch.setattr(ta, "cpu_flags", lambda: {"avx512f"})
    assert not ta.wanted()                       # the CPU cannot run it at all
    monkeypatch.delenv("DOMINOTREE_TREE_ATTENTION")
    assert ta.wanted(torch.float32)              # fp32: AVX-512F is enough, AMX or not
    monkeypatch.setattr(ta, "cpu_flags", lambda: {"avx512f", "avx512_bf16", "amx_bf16"})
    assert ta.wanted(torch.float32)
    monkeypatch.setenv("DOMINOTREE_TREE_ATTENTION", "0")
    assert not ta.wanted(torch.float32)
    monkeypatch.setattr(ta, "cpu_flags", lambda: {"avx2"})
    monkeypatch.setenv("DOMINOTREE_TREE_ATTENTION", "1")
    assert not ta.wanted(torch.float32) and not ta.wanted(torch.float16)


@needs_kernel
def test_grouped_sdpa_sends_tree_steps_to_the_kernel(kernel, monkeypatch):
    seen = []
    real = kernel.tree_attention
    monkeypatch.setattr(ta._state["module"], "tree_attention", lambda *a: seen.append(a[0].shape) or real(*a))
    q, k, v = qkv(6, 5, 40, 64, seed=15)          # 6 query heads on 3 key/value heads
    k, v = k[:, :3].contiguous(), v[:, :3].contiguous()
    mask = tree_mask(5, 40, seed=16)
    out = grouped_sdpa(q, k, v, mask)
    assert seen == [torch.Size([3, 10, 64])]      # 2 query heads folded per key/value head
    with ta.reference_attention():
        ref = grouped_sdpa(q, k, v, mask)
    assert seen == [torch.Size([3, 10, 64])]      # the reference ran on SDPA
    assert (out.float() - ref.float()).abs().max() < 3e-2
    grouped_sdpa(q[:, :, :1], k, v, None)
    assert seen[1:] == [torch.Size([3, 2, 64])]    # a one-token step: the kernel too
    grouped_sdpa(q, k, v, None)
    assert len(seen) == 2                          # unmasked blocks (the drafter's) keep SDPA


@needs_kernel
@pytest.mark.parametrize("method", ["ddtree", "dominotree"])
def test_tree_decoding_stays_lossless(kernel, tiny_llama_dir, method):
    """A bf16 target (head size 16: the kernel serves its verifies) gives plain decoding's tokens."""
    calls, out, ref = decode_on_kernel(tiny_llama_dir, torch.bfloat16, method)
    assert calls and out.token_ids == ref.token_ids


def decode_on_kernel(model_dir, dtype, method):
    """(the dtypes of the kernel's calls, `method`'s greedy result, plain decoding's) on a tiny target."""
    target = dt.load_target(str(model_dir), dtype=dtype)
    drafter = random_drafter(domino=True, seed=4)
    calls = []
    real = ta._state["module"].tree_attention
    ta._state["module"].tree_attention = lambda *a: calls.append(a[0].dtype) or real(*a)
    try:
        prompt = "hello world the w7 w8 w9"
        ref = dt.generate(target, None, prompt, method="ar", max_new_tokens=40, temperature=0)
        out = dt.generate(target, drafter, prompt, method=method, max_new_tokens=40, temperature=0, budget=8)
    finally:
        ta._state["module"].tree_attention = real
    return calls, out, ref


@needs_kernel
def test_verify_logits_match_the_reference_and_switching_leaves_no_state(kernel, tiny_llama_dir):
    target = dt.load_target(str(tiny_llama_dir), dtype=torch.bfloat16)
    tree = DraftTree.from_lists([5, 6, 7, 8, 9, 10, 11], [-1, 0, 0, 1, 1, 3, 2])
    prompt = torch.randint(4, 96, (37,), generator=torch.Generator().manual_seed(17))

    def verify():
        target.prefill(prompt)
        out = target.verify(tree).logits
        target.commit([0, 2, 6])
        return out
    a = verify()
    with ta.reference_attention():
        ref = verify()
    assert ta.enabled() and torch.equal(verify(), a)        # back on after the block, the same logits
    torch.testing.assert_close(a, ref, rtol=0.05, atol=0.05)


# ---- the fp32 kernel (models run in fp32 on CPUs without bf16 hardware) ----------------------

@needs_fp32_kernel
@pytest.mark.parametrize("d", ta.HEAD_SIZES)
@pytest.mark.parametrize("rows,keys", [(2, 1), (3, 5), (8, 16), (9, 17), (17, 100), (72, 470)])
def test_fp32_as_accurate_as_sdpa_against_float64(kernel32, d, rows, keys):
    q, k, v = qkv(3, rows, keys, d, seed=rows * 1000 + keys + d, dtype=torch.float32)
    mask = tree_mask(rows, keys, seed=keys, dtype=torch.float32)
    out = ta.attention(q, k, v, mask)
    assert out.shape == q.shape and out.dtype == torch.float32
    ours, sdpa = errors(q, k, v, mask, out)
    assert ours <= 2 * sdpa + 1e-5, (ours, sdpa)
    # a bf16 mask is read as the fp32 one (a model in fp32 makes fp32 masks; others may not)
    assert torch.equal(ta.attention(q, k, v, tree_mask(rows, keys, seed=keys)), out)


@needs_fp32_kernel
def test_fp32_negative_control_a_wrong_mask_is_far_off(kernel32):
    q, k, v = qkv(3, 16, 200, 64, seed=5, dtype=torch.float32)
    mask = tree_mask(16, 200, seed=6, dtype=torch.float32)
    ours, sdpa = errors(q, k, v, mask, ta.attention(q, k, v, mask.flip(2)))
    assert ours > 1000 * (2 * sdpa + 1e-5)


@needs_fp32_kernel
def test_fp32_rows_are_computed_on_their_own_and_masked_keys_change_nothing(kernel32):
    q, k, v = qkv(3, 19, 130, 64, seed=7, dtype=torch.float32)
    mask = tree_mask(19, 130, seed=8, dtype=torch.float32)
    whole = ta.attention(q, k, v, mask)
    for rows in ([0, 1], [5, 11, 18], list(range(9, 19))):
        part = ta.attention(q[:, :, rows].contiguous(), k, v, mask[:, :, rows].contiguous())
        assert torch.equal(part, whole[:, :, rows])
    extra = torch.full((1, 3, 23, 64), 30.0)
    k2, v2 = torch.cat([k, extra], 2), torch.cat([v, -extra], 2)
    mask2 = torch.cat([mask, torch.full((1, 1, 19, 23), torch.finfo(torch.float32).min)], 3)
    assert torch.equal(ta.attention(q, k2, v2, mask2), whole)


@needs_fp32_kernel
@pytest.mark.parametrize("d", ta.HEAD_SIZES)
@pytest.mark.parametrize("context", [1, 15, 16, 47, 300])
def test_fp32_a_tree_row_is_a_one_token_step_over_the_keys_it_sees(kernel32, d, context):
    """Bit for bit, as for bf16: a node's row equals a one-token step over the context and its path."""
    tree, q, k, v, out = rows_equal_steps(d, context, torch.float32)
    # negative control: SDPA's step is within rounding of the kernel's, not equal to it
    n, groups = len(tree), 3
    keys = list(range(context)) + [context + a for a in tree.path(n - 1)]
    rows = [gi * n + n - 1 for gi in range(groups)]
    sdpa = F.scaled_dot_product_attention(q[:, :, rows], k[:, :, keys], v[:, :, keys])
    if context >= 15:
        assert not torch.equal(sdpa, out[:, :, rows]) and (sdpa - out[:, :, rows]).abs().max() < 1e-4


@needs_fp32_kernel
def test_fp32_bad_calls_raise(kernel32):
    q, k, v = qkv(2, 4, 10, 64, seed=11, dtype=torch.float32)
    mask = tree_mask(4, 10, seed=12)[0, 0]
    with pytest.raises(RuntimeError, match="fp32 mask"):
        kernel32.tree_attention(q[0], k[0], v[0], mask, 0.125)          # a bf16 mask reaches C++ only as fp32
    with pytest.raises(RuntimeError, match="one dtype"):
        kernel32.tree_attention(q[0], k[0].bfloat16(), v[0], mask.float(), 0.125)
    with pytest.raises(RuntimeError, match="head size"):
        kernel32.tree_attention(q[0, :, :, :48].contiguous(), k[0, :, :, :48].contiguous(),
                                v[0, :, :, :48].contiguous(), mask.float(), 0.125)


@needs_fp32_kernel
@pytest.mark.parametrize("method", ["ddtree", "dominotree"])
def test_fp32_tree_decoding_gives_plain_decodings_tokens(kernel32, tiny_llama_dir, method):
    calls, out, ref = decode_on_kernel(tiny_llama_dir, torch.float32, method)
    assert calls and set(calls) == {torch.float32} and out.token_ids == ref.token_ids
