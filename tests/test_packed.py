"""Pre-packed bf16 and fp32 linears: the same outputs as the plain path, lossless decoding, clean fallbacks."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dominotree as dt
from dominotree.packed import (MAX_PACKED_ROWS, PackedLinear, is_packed, pack_linears, pack_weight, packed_linear,
                              packing, packing_available, row_behaviour)
from dominotree.trees.tree import DraftTree

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN weight packing")


def _pair(tiny_llama_dir, dtype):
    plain = dt.load_target(str(tiny_llama_dir), dtype=dtype, pack=False)
    packed = dt.load_target(str(tiny_llama_dir), dtype=dtype)
    return plain, packed


@pytest.fixture(scope="module")
def bf16_pair(tiny_llama_dir):
    return _pair(tiny_llama_dir, torch.bfloat16)


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def any_pair(request, tiny_llama_dir):
    return _pair(tiny_llama_dir, request.param)


def _close(a, b):
    # oneDNN runs the same bf16 kernel on both paths (bit-identical on the CPUs measured); allow
    # one bf16 rounding step in case another CPU blocks the reduction differently. fp32: MKL blocks
    # the column-major copy's sums otherwise, an fp32 rounding step or so apart.
    tol = 1e-4 if a.dtype == torch.float32 and b.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def test_load_target_packs_bf16_and_fp32(tiny_llama_dir, any_pair):
    plain, packed = any_pair
    assert packed.packed and not plain.packed
    n_linear = sum(type(m) is nn.Linear for m in plain.model.modules())
    assert sum(isinstance(m, PackedLinear) for m in packed.model.modules()) == n_linear > 0
    assert not dt.load_target(str(tiny_llama_dir), dtype=torch.float16).packed
    # parameters and their names are untouched
    sp, sq = plain.model.state_dict(), packed.model.state_dict()
    assert sp.keys() == sq.keys() and all(torch.equal(sp[k], sq[k]) for k in sp)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rows", [1, 3, 17, MAX_PACKED_ROWS + 5])
def test_packed_linear_matches_plain(rows, dtype):
    torch.manual_seed(0)
    lin = nn.Linear(64, 200, bias=rows % 2 == 1).to(dtype)
    ref = nn.Linear(64, 200, bias=lin.bias is not None).to(dtype)
    ref.load_state_dict(lin.state_dict())
    assert pack_linears(lin) == 1
    x = torch.randn(2, rows, 64, dtype=dtype)
    with torch.inference_mode():
        out = lin(x)
        assert out.dtype == dtype
        _close(out, ref(x))


def test_fp32_weight_packs_as_a_column_major_copy(monkeypatch):
    """Without the fp32 kernel (test_fp32_linear.py) the copy is an [out, in] view of a contiguous
    [in, out] tensor, so MKL gets its "N, N" product (the one that is fast for a verify's rows); the
    weight itself is left as it was."""
    monkeypatch.setenv("DOMINOTREE_FP32_LINEAR", "0")
    torch.manual_seed(0)
    w, b = torch.randn(48, 32), torch.randn(48)
    packed = pack_weight(w)
    assert packed.shape == w.shape and packed.t().is_contiguous() and not packed.is_contiguous()
    assert packed.data_ptr() != w.data_ptr() and torch.equal(packed, w)
    for x in (torch.randn(1, 32), torch.randn(2, 5, 32)):
        _close(packed_linear(x, packed, b, pair_single=True), F.linear(x, w, b))   # fp32 never pairs


def _packed_linear_and_input():
    torch.manual_seed(0)
    lin = nn.Linear(32, 48, bias=False).to(torch.bfloat16)
    pack_linears(lin)
    return lin, torch.randn(4, 32, dtype=torch.bfloat16)


def test_weight_changed_in_place_is_repacked():
    lin, x = _packed_linear_and_input()
    with torch.inference_mode():
        before = lin(x)
    with torch.no_grad():
        lin.weight.mul_(-2)
    with torch.inference_mode():
        after = lin(x)
        _close(after, F.linear(x, lin.weight))
    _close(after, -2 * before)


def test_deepcopy_and_pickle_repack():
    import copy
    import pickle
    lin, x = _packed_linear_and_input()
    with torch.inference_mode():
        ref = lin(x)
        for clone in (copy.deepcopy(lin), pickle.loads(pickle.dumps(lin))):
            assert isinstance(clone, PackedLinear) and clone.weight.data_ptr() != lin.weight.data_ptr()
            _close(clone(x), ref)
    _close(copy.deepcopy(lin).float()(x.float()), ref)      # an fp32 copy repacks as fp32


def test_grad_falls_back_to_plain_path():
    torch.manual_seed(0)
    lin = nn.Linear(16, 8, bias=False).to(torch.bfloat16)
    pack_linears(lin)
    x = torch.randn(3, 16, dtype=torch.bfloat16, requires_grad=True)
    lin(x).float().sum().backward()
    assert lin.weight.grad is not None and x.grad is not None


def test_verify_logits_and_features_match_plain(any_pair):
    plain, packed = any_pair
    torch.manual_seed(1)
    prompt = torch.randint(4, 96, (30,))
    tree = DraftTree.from_lists([5, 6, 7, 8, 9, 10], [-1, 0, 0, 1, 1, 3])
    outs = []
    for t in (plain, packed):
        t.set_taps([1, 2])
        pre = t.prefill(prompt)
        ver = t.verify(tree)
        t.commit([0, 1])
        outs.append((pre, ver))
    (p_pre, p_ver), (q_pre, q_ver) = outs
    _close(p_pre.logits, q_pre.logits)
    _close(p_ver.logits, q_ver.logits)
    _close(p_ver.features, q_ver.features)
    assert torch.equal(p_ver.logits.argmax(-1), q_ver.logits.argmax(-1))


@pytest.mark.parametrize("method", ["ddtree", "dominotree"])
def test_lossless_on_a_packed_target(any_pair, method):
    from conftest import random_drafter
    _, packed = any_pair
    drafter = random_drafter(domino=True, seed=3).to(dtype=packed.dtype)
    pack_linears(drafter.backbone)
    prompt = "hello world the w7 w8"
    ar = dt.generate(packed, None, prompt, method="ar", max_new_tokens=40, temperature=0)
    spec = dt.generate(packed, drafter, prompt, method=method, max_new_tokens=40, temperature=0, budget=8)
    assert spec.token_ids == ar.token_ids


def test_stock_switches_to_plain_path_and_restores(any_pair, monkeypatch):
    _, packed = any_pair
    calls = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randint(4, 96, (1, 5))
    with torch.inference_mode():
        packed.model(x)
        assert not calls                       # packed: no plain F.linear for the layers
        with pytest.raises(RuntimeError):
            with packed.stock():
                packed.model(x)
                raise RuntimeError("boom")
        assert calls                           # inside stock(): the plain transformers path
        calls.clear()
        packed.model(x)
        assert not calls                       # restored after the exception


def test_only_bf16_and_fp32_modules_are_packed():
    assert pack_linears(nn.Linear(8, 8).half()) == 0 and pack_linears(nn.Linear(8, 8).double()) == 0
    assert not is_packed(nn.Sequential(nn.Linear(8, 8)))
    assert pack_linears(nn.Linear(8, 8)) == 1
    lin = nn.Linear(8, 8).to(torch.bfloat16)
    pack_linears(lin)
    with packing(lin, False):
        assert not lin.packed_enabled
    assert lin.packed_enabled


def test_bf16_drafter_checkpoint_loads_packed(tmp_path, bf16_pair):
    from conftest import random_drafter
    from dominotree.drafters import save_checkpoint
    from dominotree.drafters.checkpoint import load_checkpoint
    _, target = bf16_pair
    save_checkpoint(random_drafter(domino=True, seed=4), tmp_path / "d", dtype=torch.bfloat16)
    packed = load_checkpoint(tmp_path / "d")
    plain = load_checkpoint(tmp_path / "d")
    for m in plain.backbone.modules():
        if isinstance(m, PackedLinear):
            m.packed_enabled = False
    assert is_packed(packed.backbone) and is_packed(packed.head)
    target.set_taps(packed.target_layer_ids)
    pre = target.prefill(torch.randint(4, 96, (20,)))
    outs = []
    for d in (plain, packed):
        d.reset()
        d.add_context(pre.features, 0)
        outs.append(d.draft(5, 20, target))
    _close(outs[0].base_logits, outs[1].base_logits)
    _close(outs[0].hidden, outs[1].hidden)
    assert is_packed(load_checkpoint(tmp_path / "d", dtype=torch.float32).backbone)
    assert not is_packed(load_checkpoint(tmp_path / "d", dtype=torch.float16).backbone)


@pytest.mark.parametrize("shape", [(576, 1536), (200, 64), (960, 576)])
def test_a_paired_lone_row_gets_its_bits_among_other_rows(shape):
    out_features, in_features = shape
    g = torch.Generator().manual_seed(1)
    packed = pack_weight((torch.randn(out_features, in_features, generator=g) / in_features ** 0.5).bfloat16())
    x = torch.randn(64, in_features, generator=g).bfloat16()
    whole = packed_linear(x, packed)
    paired = torch.cat([packed_linear(x[i:i + 1], packed, pair_single=True) for i in range(64)])
    assert torch.equal(paired, whole)
    step = packed_linear(x[:1].view(1, 1, in_features), packed, pair_single=True)   # a step's [1, 1, in]
    assert step.shape == (1, 1, out_features) and torch.equal(step[0], whole[:1])


@pytest.mark.parametrize("shape", [(576, 1536), (960, 576), (3072, 576)])
def test_row_behaviour_reports_what_fresh_rows_show(shape):
    """Where the probe finds lone rows alike, 256 fresh rows are alike too; where it finds them
    differing, some fresh row differs (the projection that pairing exists for: SmolLM2's down)."""
    g = torch.Generator().manual_seed(2)
    packed = pack_weight((torch.randn(*shape, generator=g) / shape[1] ** 0.5).bfloat16())
    behaviour = row_behaviour(packed)
    assert behaviour.rows_agree
    x = torch.randn(256, shape[1], generator=g).bfloat16()
    whole = torch.cat([packed_linear(x[i:i + 128], packed) for i in (0, 128)])
    alone = torch.cat([packed_linear(x[i:i + 1], packed) for i in range(256)])
    assert torch.equal(alone, whole) != behaviour.single_differs


def test_lone_rows_pair_only_where_exact_steps_can_hold(monkeypatch):
    """Pairing costs a second row; it buys exact steps, which need the bf16 attention kernel
    (avx512_bf16). fp32, or bf16 on a CPU without that instruction: lone rows run alone."""
    import dominotree.packed as packed_module
    g = torch.Generator().manual_seed(3)
    w = torch.randn(576, 1536, generator=g) / 1536 ** 0.5
    bf16 = pack_weight(w.bfloat16())
    monkeypatch.setattr(packed_module, "cpu_facts", lambda: ("a CPU", {"avx512f", "avx512_bf16"}))
    assert packed_module.pairs_single(bf16) == row_behaviour(bf16).single_differs
    assert not packed_module.pairs_single(pack_weight(w))
    monkeypatch.setattr(packed_module, "cpu_facts", lambda: ("Ice Lake", {"avx512f", "avx512_vnni"}))
    assert not packed_module.pairs_single(bf16)
    lin = nn.Linear(1536, 576, bias=False).to(torch.bfloat16)
    pack_linears(lin)
    assert lin._pair_single is False
