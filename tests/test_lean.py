"""The drafter's lean CPU path: bit-identical to the module path, rebuilt when weights change,
and left alone wherever it could not reproduce the module path exactly."""
import pytest
import torch

import dominotree as dt
from conftest import random_drafter
from dominotree.bench.methods import parse_method
from dominotree.drafters.dflash import rope_cos_sin
from dominotree.drafters.lean import LeanBackbone, module_path
from dominotree.packed import MAX_PACKED_ROWS, pack_linears, packing, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN weight packing")


def packed_drafter(domino=False, layers=2, seed=0, dtype=torch.bfloat16):
    d = random_drafter(domino, seed=seed, layers=layers).to(dtype=dtype)
    pack_linears(d.backbone)
    if domino:
        pack_linears(d.head)
    return d


def both_paths(d, target, prompt, rounds):
    """Block outputs of the lean and the module path after the same context updates, per round."""
    target.set_taps(d.target_layer_ids)
    pre = target.prefill(prompt)
    out = []
    for lean in (True, False):
        d.use_lean = lean
        d.reset()
        d.add_context(pre.features, 0)
        hidden = []
        for i in range(rounds):
            hidden.append(d.block_hidden(7 + i, d.ctx_len, target))
            feats = pre.features[: 1 + i % 3]            # 1-3 new context rows, as after a verify
            d.add_context(feats, d.ctx_len)
        out.append(hidden)
    d.use_lean = True
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_lean_blocks_equal_the_module_path_bit_for_bit(tiny_target, dtype):
    d = packed_drafter(layers=2, dtype=dtype)
    assert d.config.num_attention_heads > d.config.num_key_value_heads   # the grouped attention runs
    assert d.lean() is not None
    lean, module = both_paths(d, tiny_target, list(range(1, 12)), rounds=6)
    for a, b in zip(lean, module):
        assert a.dtype == dtype
        if dtype == torch.bfloat16:
            assert torch.equal(a, b)
        else:   # MKL may block a fused product's sums otherwise than its parts' (equal here)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_lean_path_actually_runs(tiny_target, monkeypatch):
    d = packed_drafter()
    calls = []
    real = LeanBackbone.forward
    monkeypatch.setattr(LeanBackbone, "forward", lambda self, *a: calls.append(1) or real(self, *a))
    both_paths(d, tiny_target, [1, 5, 6], rounds=2)
    assert len(calls) == 2          # the lean half of both_paths only


def test_negative_control_a_perturbed_lean_weight_is_caught(tiny_target):
    d = packed_drafter()
    lean = d.lean()
    w = d.backbone.layers[0].mlp.down_proj.weight
    lean.layers[0]["down"] = torch.ops.mkldnn._reorder_linear_weight(w.detach() * 1.01, 16)
    a, b = both_paths(d, tiny_target, [1, 5, 6, 7], rounds=1)
    assert not torch.equal(a[0], b[0])


def test_weights_changed_in_place_rebuild_the_lean_path(tiny_target):
    d = packed_drafter()
    first = d.lean()
    with torch.no_grad():
        d.backbone.layers[0].self_attn.k_proj.weight.mul_(0.5)
    assert d.lean() is not first
    a, b = both_paths(d, tiny_target, [1, 5, 6, 7], rounds=3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert d.lean() is d.lean()        # kept while nothing changes


def test_lean_path_only_where_it_is_exact(tiny_target):
    plain = random_drafter(False, layers=2)
    assert plain.lean() is None                         # unpacked linears: the module path
    d = packed_drafter()
    with packing(d.backbone, False):
        assert d.lean() is None                         # the plain path was asked for
    d.use_lean = False
    assert d.lean() is None
    d.use_lean = True
    assert packed_drafter().to(dtype=torch.float32).lean() is not None   # cast to fp32: repacked as fp32
    assert packed_drafter().to(dtype=torch.float16).lean() is None       # fp16: the plain path
    fused = random_drafter(False, layers=1).to(dtype=torch.bfloat16)
    fused.config.anchor_fusion = True
    pack_linears(fused.backbone)
    assert fused.lean() is None


def test_prompt_rows_above_the_packed_limit_take_the_module_path(tiny_target, monkeypatch):
    d = packed_drafter()
    seen = []
    real = LeanBackbone.context_kv
    monkeypatch.setattr(LeanBackbone, "context_kv", lambda self, ctx, start: seen.append(ctx.shape[1]) or real(self, ctx, start))
    d.reset()
    d.add_context(torch.randn(MAX_PACKED_ROWS + 1, 2 * 64), 0)
    d.add_context(torch.randn(3, 2 * 64), MAX_PACKED_ROWS + 1)
    assert seen == [3]


def test_rotary_table_rows_equal_per_call_angles():
    d = packed_drafter()
    lean = d.lean()
    hd, theta = d.config.head_dim, d.config.rope_theta
    for start, n in ((0, 8), (1019, 16), (1500, 3), (5000, 16)):   # across the table's growth
        cos, sin = lean._rotary(start, n)
        ref_cos, ref_sin = rope_cos_sin(torch.arange(start, start + n)[None], hd, theta)
        assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0])


@pytest.mark.parametrize("method", ["dflash", "dominotree"])
def test_generation_is_the_same_on_either_path(tiny_target, method):
    d = packed_drafter(domino=method == "dominotree")
    kw = dict(method=method, max_new_tokens=24, budget=6)
    if method == "dflash":
        kw.pop("budget")
    a = dt.generate(tiny_target, d, [1, 5, 6, 9], **kw)
    with module_path(d):
        assert d.lean() is None
        b = dt.generate(tiny_target, d, [1, 5, 6, 9], **kw)
    assert d.use_lean
    assert a.token_ids == b.token_ids and a.stats["accepted_per_round"] == b.stats["accepted_per_round"]


def test_bench_switch():
    assert parse_method("dominotree:budget=8,lean=0").lean is False
    assert parse_method("ddtree").lean is True
    with pytest.raises(ValueError, match="but pack, gqa"):
        parse_method("ar:lean=0")


def test_copies_and_pickles_remake_the_lean_path(tiny_target):
    import copy
    import pickle
    d = packed_drafter(domino=True)
    a = dt.generate(tiny_target, d, [1, 5, 6, 9], method="dominotree", max_new_tokens=16, budget=6)
    assert d.lean() is not None
    for clone in (copy.deepcopy(d), pickle.loads(pickle.dumps(d))):
        assert clone._lean_kept is None and clone.lean() is not None
        b = dt.generate(tiny_target, clone, [1, 5, 6, 9], method="dominotree", max_new_tokens=16, budget=6)
        assert a.token_ids == b.token_ids


def test_a_request_checks_the_weights_once(tiny_target, monkeypatch):
    import dominotree.drafters.lean as lean_mod
    d = packed_drafter(domino=True)
    calls = []
    real = lean_mod.state_key
    monkeypatch.setattr(lean_mod, "state_key", lambda b: calls.append(1) or real(b))
    r = dt.generate(tiny_target, d, [1, 7, 8], method="dominotree", max_new_tokens=24, budget=6)
    assert r.stats["rounds"] > 3 and len(calls) == 1
    first = d._lean_now()
    with torch.no_grad():                   # changed in place: seen from the next request on
        d.backbone.layers[0].self_attn.k_proj.weight.mul_(0.5)
    assert d._lean_now() is first
    d.reset()
    assert d._lean_now() is not first
    a, b = both_paths(d, tiny_target, [1, 5, 6, 7], rounds=3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
