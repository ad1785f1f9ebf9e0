"""TargetModel: tree verification equals running each path alone; commit equals a fresh prefill."""
import pytest
import torch

from dominotree import DraftTree


def path_logits(target, prefix, path_tokens):
    """Logits at the last token of prefix + path, computed from scratch with a plain forward."""
    ids = torch.tensor(prefix + path_tokens)[None]
    with torch.inference_mode():
        return target.model(input_ids=ids).logits[0, -1].float()


@pytest.mark.parametrize("which", ["tiny_target", "tiny_qwen3_target"])
def test_verify_matches_each_path(which, request):
    target = request.getfixturevalue(which)
    prefix = [1, 10, 11, 12, 13, 14]
    # root 20; a tree with several branches, depth 5
    tokens = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    parents = [-1, 0, 0, 1, 1, 2, 3, 6, 7, 5]
    tree = DraftTree.from_lists(tokens, parents)
    assert tree.max_depth == 5
    target.set_taps([1, 3])
    target.prefill(prefix)
    out = target.verify(tree)
    for i in range(len(tree)):
        toks = [tokens[j] for j in tree.path(i)]
        ref = path_logits(target, prefix, toks)
        assert torch.allclose(out.logits[i], ref, atol=1e-4), f"node {i}"
    assert out.features.shape == (len(tree), 2 * target.hidden_size)
    target.commit([0])


def test_features_are_layer_outputs(tiny_target):
    target = tiny_target
    prompt = [1, 5, 6, 7, 8]
    target.set_taps([0, 2])
    out = target.prefill(prompt)
    with torch.inference_mode():
        hs = target.model(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states
    ref = torch.cat([hs[1][0], hs[3][0]], -1)
    assert torch.allclose(out.features, ref, atol=1e-5)


def test_commit_then_continue_equals_fresh_prefill(tiny_target):
    target = tiny_target
    prefix = [1, 10, 11, 12]
    tokens = [30, 31, 32, 33, 34, 35, 36]
    parents = [-1, 0, 0, 2, 2, 4, 1]
    tree = DraftTree.from_lists(tokens, parents)
    target.prefill(prefix)
    target.verify(tree)
    path = tree.path(5)                      # root -> 2 -> 4 -> 5 (a non-contiguous path)
    assert path == [0, 2, 4, 5]
    target.commit(path)
    assert target.length == len(prefix) + len(path)
    nxt = DraftTree.single(40)
    cont = target.verify(nxt).logits[0]
    target.commit([0])
    accepted = prefix + [tokens[j] for j in path] + [40]
    ref = path_logits(target, accepted[:-1], accepted[-1:])
    assert torch.allclose(cont, ref, atol=1e-4)
    # and the cache itself equals a cache built from scratch
    fresh_k = _keys_after_prefill(target, accepted)
    assert torch.allclose(target.cache.layers[0].keys[0], fresh_k, atol=1e-4)


def _keys_after_prefill(target, ids):
    from transformers import DynamicCache
    cache = DynamicCache(config=target.config)
    with torch.inference_mode():
        target.model(input_ids=torch.tensor([ids]), use_cache=True, **{target._cache_kw: cache})
    return cache.layers[0].keys[0]


def test_commit_cost_does_not_touch_the_prefix(tiny_target):
    """Only the tail is rewritten: the prefix rows keep their storage."""
    target = tiny_target
    target.prefill(list(range(1, 60)))
    before = target.cache.layers[0].keys[..., :59, :].clone()
    target.verify(DraftTree.from_lists([5, 6, 7, 8], [-1, 0, 0, 2]))
    target.commit([0, 2, 3])
    assert torch.equal(target.cache.layers[0].keys[..., :59, :], before)


def test_misuse_is_rejected(tiny_target):
    target = tiny_target
    target.prefill([1, 2, 3])
    with pytest.raises(RuntimeError):
        target.commit([0])
    target.verify(DraftTree.single(5))
    with pytest.raises(RuntimeError):
        target.verify(DraftTree.single(5))
    with pytest.raises(ValueError):
        target.commit([1])
    target.rollback()
    assert target.cache.layers[0].keys.shape[-2] == 3
    with pytest.raises(ValueError):
        target.prefill([])
    with pytest.raises(ValueError):
        target.set_taps([99])


def kernel_cpu(dtype) -> bool:
    from dominotree import tree_attention as ta
    return ta.cpu_runs(dtype)


needs_kernel = pytest.mark.skipif(not kernel_cpu(torch.bfloat16), reason="the CPU has no avx512_bf16 (no tree-attention kernel)")


def stepped_logits(target, prefix, path_tokens):
    """Logits at the last token of prefix + path as plain decoding computes them: one token a step."""
    logits = target.prefill(prefix, features=False).logits[-1]
    for t in path_tokens:
        logits = target.verify(DraftTree.single(t), features=False).logits[0]
        target.commit([0])
    return logits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_exact_steps_every_verify_row_is_the_step_of_its_token(tiny_llama_dir, dtype):
    """Bit for bit, for random trees over random contexts: a node's verify logits are the logits a
    one-token step gives once the node's path is in the cache (plain decoding's numbers); in bf16
    on AVX-512 BF16 CPUs, in fp32 (the fp32 linear and attention kernels) on AVX-512F ones."""
    import dominotree as dt
    if not kernel_cpu(dtype):
        pytest.skip(f"no {dtype} tree-attention kernel on this CPU")
    target = dt.load_target(str(tiny_llama_dir), dtype=dtype)
    if not target.exact_steps:
        pytest.skip("the tree-attention kernel did not build here")
    g = torch.Generator().manual_seed(5)
    for trial in range(6):
        prefix = torch.randint(4, 90, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist()
        n = int(torch.randint(2, 24, (1,), generator=g))
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
        tokens = torch.randint(4, 90, (n,), generator=g).tolist()
        tree = DraftTree.from_lists(tokens, parents)
        target.prefill(prefix, features=False)
        out = target.verify(tree, features=False).logits
        target.commit([0])
        for i in range(n):
            ref = stepped_logits(target, prefix, [tokens[j] for j in tree.path(i)])
            assert torch.equal(out[i], ref), (trial, i)


@pytest.mark.skipif(not kernel_cpu(torch.float32), reason="the CPU has no avx512f")
def test_fp32_exact_steps_need_both_kernels(tiny_llama_dir, monkeypatch):
    import dominotree as dt
    import dominotree.tree_attention as ta
    from dominotree import fp32_linear
    target = dt.load_target(str(tiny_llama_dir), dtype=torch.float32)
    if not (ta.enabled(torch.float32) and fp32_linear.available()):
        pytest.skip("a kernel did not build here")
    assert target.exact_steps
    with ta.reference_attention():                  # SDPA
        assert not target.exact_steps
    monkeypatch.setenv("DOMINOTREE_FP32_LINEAR", "0")   # MKL's copy: lone rows round otherwise
    assert not dt.load_target(str(tiny_llama_dir), dtype=torch.float32).exact_steps


@needs_kernel
def test_exact_steps_says_when_it_holds(tiny_llama_dir):
    import dominotree as dt
    import dominotree.tree_attention as ta
    target = dt.load_target(str(tiny_llama_dir), dtype=torch.bfloat16)
    if not ta.enabled():
        pytest.skip("the tree-attention kernel did not build here")
    assert target.exact_steps
    with ta.reference_attention():                  # SDPA: other numbers for a row than for a step
        assert not target.exact_steps
    target.use_lean = False                         # transformers' forward
    assert not target.exact_steps
    assert not dt.load_target(str(tiny_llama_dir), dtype=torch.float16).exact_steps
    assert not dt.load_target(str(tiny_llama_dir), dtype=torch.bfloat16, pack=False).exact_steps
