"""Packed GQA attention: the logits of transformers' `sdpa`, lossless decoding, clean switching."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import dominotree as dt
import dominotree.gqa_attention as gqa
from dominotree import tree_attention
from conftest import random_drafter, tiny_config_kwargs
from dominotree.gqa_attention import NAME, applies, stock_attention, use_gqa_attention
from dominotree.trees.tree import DraftTree

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def pairs(tiny_llama_dir):
    """(stock sdpa, packed GQA) targets of the tiny GQA Llama (4 query heads, 2 key/value heads)."""
    return {dtype: tuple(dt.load_target(str(tiny_llama_dir), dtype=dtype, pack=False, gqa=use) for use in (False, True))
            for dtype in DTYPES}


@pytest.fixture
def calls(monkeypatch):
    """The query shape of every SDPA call: [1, 2, ...] packed (2 key/value heads), [1, 4, ...] not
    (with the tree-attention kernel off: it would take the packed steps)."""
    seen = []
    real = gqa.F.scaled_dot_product_attention
    monkeypatch.setattr(gqa.F, "scaled_dot_product_attention", lambda *a, **k: seen.append(a[0].shape) or real(*a, **k))
    with tree_attention.reference_attention():
        yield seen


def _same(a, b, dtype):
    # each query row meets the same keys; the kernel only blocks the rows differently (one bf16
    # rounding step at most): far below what a head or mask mix-up does (see the control below)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def test_load_target_switches_gqa_models_only(pairs, tiny_llama_dir, tmp_path):
    stock, packed = pairs[torch.float32]
    assert packed.gqa_attention and packed.model.config._attn_implementation == NAME
    assert not stock.gqa_attention and stock.model.config._attn_implementation == "sdpa"
    # no grouped heads (4 query, 4 key/value): nothing to pack, transformers' sdpa stays
    torch.manual_seed(0)
    mha = LlamaForCausalLM(LlamaConfig(**{**tiny_config_kwargs(), "num_key_value_heads": 4}))
    assert not applies(mha) and not use_gqa_attention(mha) and mha.config._attn_implementation == "sdpa"
    eager = LlamaForCausalLM(LlamaConfig(**tiny_config_kwargs(), attn_implementation="eager"))
    assert not use_gqa_attention(eager) and eager.config._attn_implementation == "eager"


def test_without_the_transformers_extension_points_models_keep_sdpa(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(gqa, "AVAILABLE", False)
    t = dt.load_target(str(tiny_llama_dir), dtype=torch.float32)
    assert not t.gqa_attention and t.model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_step_and_tree_verify_give_stock_logits(pairs, dtype, calls):
    stock, packed = pairs[dtype]
    torch.manual_seed(1)
    prompt = torch.randint(4, 96, (37,))
    tree = DraftTree.from_lists([5, 6, 7, 8, 9, 10, 11], [-1, 0, 0, 1, 1, 3, 2])
    chain = DraftTree.from_lists([12], [-1])       # a one-token step: no mask
    outs = []
    for t in (stock, packed):
        calls.clear()
        # SDPA's verify (the tree-attention kernel has its own tests: tests/test_tree_attention.py)
        with tree_attention.reference_attention():
            t.set_taps([1, 2])
            pre = t.prefill(prompt)
            ver = t.verify(tree)
            t.commit([0, 2, 6])
            step = t.verify(chain)
            t.commit([0])
        outs.append((pre, ver, step))
    for a, b in zip(*outs):
        _same(a.logits, b.logits, dtype)
        _same(a.features, b.features, dtype)
    # per layer of the packed target: the prefill handed to transformers' sdpa (4 heads, 37 rows),
    # the verify (2 key/value heads x 7 rows) and the step (2 x 1) packed
    n = packed.num_layers
    assert calls == [torch.Size([1, 4, 37, 16])] * n + [torch.Size([1, 2, 14, 16])] * n + [torch.Size([1, 2, 2, 16])] * n


def test_a_wrong_head_grouping_is_caught(pairs, monkeypatch):
    """Negative control: interleaving the groups the other way (head h -> key/value head h % 2)
    changes the logits far beyond the tolerance above."""
    stock, packed = pairs[torch.float32]
    torch.manual_seed(2)
    prompt = torch.randint(4, 96, (20,))
    tree = DraftTree.from_lists([5, 6, 7], [-1, 0, 1])

    def verify(t):
        t.prefill(prompt)
        out = t.verify(tree).logits
        t.commit([0])
        return out
    ref = verify(stock)
    real = gqa.F.scaled_dot_product_attention

    def wrong(q, k, v, **kw):
        B, Hk, rows, D = q.shape            # packed rows g * n + i -> i * 2 + g
        q = q.view(B, Hk, 2, rows // 2, D).transpose(2, 3).reshape(B, Hk, rows, D)
        return real(q, k, v, **kw)
    monkeypatch.setattr(gqa.F, "scaled_dot_product_attention", wrong)
    with tree_attention.reference_attention():      # the grouping SDPA sees (the kernel's has its tests)
        assert (verify(packed) - ref).abs().max() > 1e-2


@pytest.mark.parametrize("method", ["ar", "ddtree", "dominotree"])
def test_decoding_is_unchanged(pairs, method):
    stock, packed = pairs[torch.float32]
    drafter = None if method == "ar" else random_drafter(domino=True, seed=4)
    prompt = "hello world the w7 w8 w9"
    ref = dt.generate(stock, None, prompt, method="ar", max_new_tokens=40, temperature=0)
    out = dt.generate(packed, drafter, prompt, method=method, max_new_tokens=40, temperature=0, budget=8)
    assert out.token_ids == ref.token_ids


def test_stock_switches_to_sdpa_and_restores(pairs, calls):
    _, packed = pairs[torch.float32]
    x = torch.randint(4, 96, (1, 1))
    with torch.inference_mode():
        with pytest.raises(RuntimeError):
            with packed.stock():
                assert packed.model.config._attn_implementation == "sdpa"
                packed.model(x)
                raise RuntimeError("boom")
        assert calls == [torch.Size([1, 4, 1, 16])] * 4     # inside stock(): transformers' own sdpa
        assert packed.gqa_attention            # restored after the exception
        calls.clear()
        packed.model(x)
        assert calls == [torch.Size([1, 2, 2, 16])] * 4     # packed again
    stock, _ = pairs[torch.float32]
    with stock_attention(stock.model):         # a model never switched stays as it is
        assert stock.model.config._attn_implementation == "sdpa"
    assert not stock.gqa_attention


def test_left_padded_batches_decode_like_single_sequences(pairs, calls):
    """`train data` decodes left-padded batches under padding masks (prefill and steps): on the packed
    attention every row equals that prompt decoded alone, and the stock path's rows."""
    from dominotree.train.data import _generate_batch
    stock, packed = pairs[torch.float32]
    torch.manual_seed(3)
    batch = [(torch.randint(4, 96, (n,)).tolist(), "p") for n in (5, 11, 8)]
    rows = {}
    for name, t in (("stock", stock), ("packed", packed)):
        calls.clear()
        rows[name] = [s.tokens.tolist() for s in _generate_batch(t, batch, 2, 12, False, 1.0, None)]
    # the packed run packed the padded prefill (3 rows x 2 groups x 11 positions) and the steps
    assert calls[0] == torch.Size([3, 2, 22, 16]) and calls[packed.num_layers] == torch.Size([3, 2, 2, 16])
    assert rows["packed"] == rows["stock"]
    for (ids, _), row in zip(batch, rows["packed"]):
        alone = dt.generate(packed, None, ids, method="ar", max_new_tokens=12, temperature=0).token_ids
        assert row[len(ids):] == alone
