"""The fp32 linear kernel: F.linear's numbers up to fp32 rounding, every row the same alone as among
others, bf16 blocks only where they are exact, and the packed path that uses it."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dominotree import fp32_linear
from dominotree.packed import PackedLinear, pack_linears, pack_weight, packed_linear, row_behaviour

pytestmark = pytest.mark.skipif(not fp32_linear.available(), reason="needs AVX-512F and a C++ compiler")


def _weight(out_features, in_features, seed=0, bf16_values=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) / in_features ** 0.5
    return w.bfloat16().float() if bf16_values else w


# shapes with a partial last block (200, 961) and SmolLM2's fused products
@pytest.mark.parametrize("shape", [(200, 64), (961, 576), (576, 1536), (3072, 576)])
@pytest.mark.parametrize("rows", [1, 2, 5, 9, 16, 17, 40])
def test_products_equal_float64_up_to_fp32_rounding(shape, rows):
    w = _weight(*shape)
    packed = fp32_linear.pack(w)
    assert packed.stored_in_bf16 and packed.shape == w.shape and packed.dtype == torch.float32
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))
    y = fp32_linear.linear(x, packed)
    ref = (x.double() @ w.double().t()).float()
    assert y.shape == (rows, shape[0]) and y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(576, 576), (576, 1536), (1000, 96)])
def test_a_row_alone_gets_the_bits_it_gets_among_others(shape):
    """Each output is its sum in k order whatever the rows around it (1 to 128 rows, any place)."""
    packed = fp32_linear.pack(_weight(*shape, seed=1))
    x = torch.randn(128, shape[1], generator=torch.Generator().manual_seed(2))
    whole = fp32_linear.linear(x, packed)
    alone = torch.cat([fp32_linear.linear(x[i:i + 1], packed) for i in range(128)])
    assert torch.equal(alone, whole)
    for m in (2, 3, 7, 14, 15, 16, 17, 29, 64):
        assert torch.equal(fp32_linear.linear(x[5:5 + m], packed), whole[5:5 + m])
    assert row_behaviour(packed).rows_agree and not row_behaviour(packed).single_differs


def test_weights_that_are_not_bf16_values_stay_fp32():
    w = _weight(100, 48, bf16_values=False)
    packed = fp32_linear.pack(w)
    assert not packed.stored_in_bf16            # bf16 blocks would round them: a different model
    x = torch.randn(3, 48)
    torch.testing.assert_close(fp32_linear.linear(x, packed), (x.double() @ w.double().t()).float(),
                               rtol=1e-5, atol=1e-5)
    # negative control: those weights in bf16 blocks give visibly other products
    rounded = fp32_linear.pack(w.bfloat16().float())
    assert (fp32_linear.linear(x, rounded) - fp32_linear.linear(x, packed)).abs().max() > 1e-4


def test_bias_and_leading_dimensions():
    w, b = _weight(80, 32), torch.randn(80)
    packed = fp32_linear.pack(w)
    x = torch.randn(2, 3, 32)
    torch.testing.assert_close(fp32_linear.linear(x, packed, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    x_t = torch.randn(32, 5).t()                  # a non-contiguous input
    torch.testing.assert_close(fp32_linear.linear(x_t, packed), F.linear(x_t, w), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="fp32"):
        fp32_linear.pack(w.bfloat16())


def test_packed_fp32_modules_run_on_the_kernel(monkeypatch):
    lin = nn.Linear(64, 48, bias=True)
    with torch.no_grad():
        lin.weight.copy_(lin.weight.bfloat16().float())
    ref = F.linear
    pack_linears(lin)
    assert isinstance(lin, PackedLinear) and isinstance(lin._packed, fp32_linear.Blocked)
    calls = []
    real = fp32_linear.linear
    monkeypatch.setattr(fp32_linear, "linear", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(4, 64)
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), ref(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert calls == [1]


def test_the_switch_keeps_the_mkl_copy(monkeypatch):
    monkeypatch.setenv("DOMINOTREE_FP32_LINEAR", "0")
    packed = pack_weight(_weight(48, 32))
    assert not isinstance(packed, fp32_linear.Blocked) and packed.t().is_contiguous()
    x = torch.randn(2, 32)
    torch.testing.assert_close(packed_linear(x, packed), F.linear(x, _weight(48, 32)), rtol=1e-5, atol=1e-5)


def test_the_kernel_runs_on_torchs_threads():
    """at::parallel_for is serial in an extension built without OpenMP (the kernel then used one core
    of two: half the speed of a verify's products)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert fp32_linear._load().parallel_threads(64) == 2
        torch.set_num_threads(1)
        assert fp32_linear._load().parallel_threads(64) == 1
    finally:
        torch.set_num_threads(threads)
