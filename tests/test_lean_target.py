"""The target's lean step path: bit-identical to transformers' forward, rebuilt when weights
change, and left alone wherever it could not reproduce that forward exactly."""
import pytest
import torch

import dominotree as dt
from conftest import make_tokenizer, random_drafter, tiny_config_kwargs
from transformers import LlamaConfig, LlamaForCausalLM
from dominotree import DraftTree
from dominotree.bench.methods import parse_method
from dominotree.gqa_attention import stock_attention
from dominotree.lean_target import LeanLlama, transformers_forward
from dominotree.packed import packing, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN weight packing")

PROMPT = [1, 10, 11, 12, 13, 14]
TREE = DraftTree.from_lists([30, 31, 32, 33, 34, 35, 36], [-1, 0, 0, 2, 2, 4, 1])


@pytest.fixture(scope="module")
def bf16_target(tiny_llama_dir):
    t = dt.load_target(str(tiny_llama_dir), dtype=torch.bfloat16)
    assert t.packed and t.config.num_attention_heads > t.config.num_key_value_heads
    return t


def steps(target, lean: bool, taps=(0, 3)):
    """Logits and features of a tree verify, a commit, then a one-token step, on either path."""
    target.use_lean = lean
    try:
        target.set_taps(list(taps))
        target.prefill(PROMPT)
        tree = target.verify(TREE)
        target.commit(TREE.path(5))
        step = target.verify(DraftTree.single(40))
        target.commit([0])
        return [tree.logits, tree.features, step.logits, step.features]
    finally:
        target.use_lean = True


def test_lean_steps_equal_transformers_bit_for_bit(bf16_target):
    assert bf16_target.lean
    # layer 0, a middle layer and the last one (whose transformers hidden state is the normed one)
    for taps in ((0, 3), (1, 2)):
        for a, b in zip(steps(bf16_target, True, taps), steps(bf16_target, False, taps)):
            assert torch.equal(a, b)


def test_fp32_lean_steps_equal_transformers(tiny_target):
    """fp32 weights are packed too (column-major copies), and the lean path runs on them."""
    assert tiny_target.dtype == torch.float32 and tiny_target.packed and tiny_target.lean
    for a, b in zip(steps(tiny_target, True), steps(tiny_target, False)):
        # MKL may block a fused product's sums otherwise than its parts'
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with packing(tiny_target.model, False):
        assert not tiny_target.lean


def test_lean_path_actually_runs_and_not_for_prompts(bf16_target, monkeypatch):
    calls = []
    real = LeanLlama.forward
    monkeypatch.setattr(LeanLlama, "forward", lambda self, ids, *a: calls.append(len(ids)) or real(self, ids, *a))
    steps(bf16_target, True)
    assert calls == [len(TREE), 1]          # the tree and the step; the prompt stays on transformers
    calls.clear()
    steps(bf16_target, False)
    assert calls == []


def test_lean_follows_the_attention_switch(bf16_target):
    """Under gqa=0 the lean path attends with transformers' sdpa, and still equals its forward."""
    with stock_attention(bf16_target.model):
        assert bf16_target.lean
        for a, b in zip(steps(bf16_target, True), steps(bf16_target, False)):
            assert torch.equal(a, b)


def test_qwen3_steps_equal_transformers_bit_for_bit(tiny_qwen3_dir):
    """Qwen3: the Llama layout plus per-head RMSNorms on queries and keys before the rotary."""
    t = dt.load_target(str(tiny_qwen3_dir), dtype=torch.bfloat16)
    assert t.lean and t.model.model.layers[0].self_attn.q_norm is not None
    with torch.no_grad():   # non-trivial head norms, so that leaving them out would show
        for layer in t.model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    for a, b in zip(steps(t, True), steps(t, False)):
        assert torch.equal(a, b)


def test_lean_stays_off_where_it_cannot_reproduce(bf16_target, tiny_target, tiny_llama_dir, tmp_path):
    assert not dt.load_target(str(tiny_llama_dir), dtype=torch.float16).lean    # fp16: not packed
    with packing(bf16_target.model, False):
        assert not bf16_target.lean
    with bf16_target.stock():
        assert not bf16_target.lean
    with transformers_forward(bf16_target):
        assert not bf16_target.lean
    assert bf16_target.lean
    assert not dt.load_target(str(tiny_llama_dir), dtype=torch.bfloat16, pack=False).lean
    torch.manual_seed(0)                                 # biases: not the Llama layout this path runs
    biased = LlamaForCausalLM(LlamaConfig(**tiny_config_kwargs(), attention_bias=True))
    biased.save_pretrained(tmp_path / "biased")
    make_tokenizer().save_pretrained(tmp_path / "biased")
    biased = dt.load_target(str(tmp_path / "biased"), dtype=torch.bfloat16)
    assert biased.packed and not biased.lean
    assert steps(biased, True)[0].shape == (len(TREE), biased.vocab_size)   # on transformers' forward


def test_lean_is_rebuilt_when_a_weight_changes(tiny_llama_dir):
    t = dt.load_target(str(tiny_llama_dir), dtype=torch.bfloat16)
    steps(t, True)
    before = t._lean
    with torch.no_grad():
        t.model.model.layers[1].mlp.down_proj.weight.mul_(1.5)
        t.model.model.layers[2].input_layernorm.weight.add_(0.25)
    lean = steps(t, True)
    assert t._lean is not before
    for a, b in zip(lean, steps(t, False)):
        assert torch.equal(a, b)


def test_lean_and_transformers_generate_the_same_tokens(bf16_target, monkeypatch):
    trees = []
    real = LeanLlama.forward
    monkeypatch.setattr(LeanLlama, "forward", lambda self, ids, *a: trees.append(len(ids)) or real(self, ids, *a))
    drafter = random_drafter(True)
    runs = [dict(method="ar"), dict(method="ar", temperature=1.0, seed=3),
            dict(method="dominotree", budget=6), dict(method="ddtree", budget=6, temperature=1.0, seed=4)]
    out = {}
    for lean in (True, False):
        bf16_target.use_lean = lean
        try:
            out[lean] = [dt.generate(bf16_target, drafter, PROMPT, max_new_tokens=24, **r) for r in runs]
        finally:
            bf16_target.use_lean = True
    for a, b in zip(out[True], out[False]):
        assert a.token_ids == b.token_ids and len(a.token_ids) > 1
    assert max(trees) == 7          # the budget-6 trees were verified on the lean path


def test_bench_switch_runs_ar_on_transformers_forward():
    spec = parse_method("ar:lean_target=0")
    assert spec.method == "ar" and not spec.lean_target
    assert parse_method("dominotree:budget=8,lean_target=0").lean_target is False
    assert parse_method("ar").lean_target
