"""Drafter modules and checkpoints in the published DFlash / Domino layouts."""
import json

import pytest
import torch

import dominotree as dt
from conftest import drafter_config, random_drafter, raw_config
from dominotree.drafters import DominoHead, DrafterLoadError, default_target_layer_ids, load_checkpoint

DFLASH_KEYS = {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight",
               "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
               "layers.0.self_attn.o_proj.weight", "layers.0.self_attn.q_norm.weight",
               "layers.0.self_attn.k_norm.weight", "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight",
               "layers.0.mlp.down_proj.weight", "layers.0.input_layernorm.weight",
               "layers.0.post_attention_layernorm.weight"}
DOMINO_KEYS = {"prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight", "embed_proj.2.weight"}


def test_default_target_layer_ids_match_published():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(30, 1) == [15]


@pytest.mark.parametrize("domino", [False, True])
def test_checkpoint_layout_and_round_trip(tiny_target, ckpt_dir, domino):
    from safetensors.torch import load_file
    path, original = ckpt_dir(domino)
    keys = set(load_file(str(path / "model.safetensors")))
    assert DFLASH_KEYS <= keys
    assert (DOMINO_KEYS <= keys) == domino
    cfg = raw_config(path)
    assert cfg["block_size"] == 8 and cfg["dflash_config"]["mask_token_id"] == 3
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 2]
    if domino:
        assert cfg["architectures"] == ["DominoDraftModel"]
        dc = cfg["dflash_config"]
        assert dc["projector_type"] == "domino" and dc["emb_dim"] == 16 and dc["gru_hidden_dim"] == 24
        assert dc["pure_draft_prefix_len"] == 1 and dc["shift_label"] is True
        assert load_file(str(path / "model.safetensors"))["prefix_gru.weight_ih_l0"].shape == (72, 64)
        assert load_file(str(path / "model.safetensors"))["embed_proj.0.weight"].shape == (16, 64 + 24)
    else:
        assert cfg["architectures"] == ["DFlashDraftModel"]
    loaded = dt.load_drafter(str(path), target=tiny_target, pack=False)   # the module path, as `original`
    assert type(loaded) is type(original)
    a = dt.generate(tiny_target, original, [1, 5, 6], method="domino" if domino else "dflash", max_new_tokens=12)
    b = dt.generate(tiny_target, loaded, [1, 5, 6], method="domino" if domino else "dflash", max_new_tokens=12)
    assert a.token_ids == b.token_ids and a.stats["accepted_per_round"] == b.stats["accepted_per_round"]
    # identical draft outputs
    for d in (original, loaded):
        tiny_target.set_taps(d.target_layer_ids)
        pre = tiny_target.prefill([1, 5, 6, 7])
        d.reset()
        d.add_context(pre.features, 0)
    oa, ob = original.draft(9, 4, tiny_target), loaded.draft(9, 4, tiny_target)
    assert torch.equal(oa.base_logits, ob.base_logits)
    packed = dt.load_drafter(str(path), target=tiny_target)      # fp32 packed: up to fp32 rounding
    packed.reset()
    packed.add_context(pre.features, 0)
    torch.testing.assert_close(packed.draft(9, 4, tiny_target).base_logits, oa.base_logits, rtol=1e-4, atol=1e-4)


def test_domino_architecture_name_variants(tiny_target, ckpt_dir):
    """Published Domino checkpoints also appear as DFlashDraftModel: projector_type decides."""
    path, _ = ckpt_dir(True)
    cfg = raw_config(path)
    cfg["architectures"] = ["DFlashDraftModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    assert hasattr(load_checkpoint(path), "head")


def test_shift_label_sets_the_number_of_depths(tiny_target):
    assert random_drafter(True, shift_label=True).num_depths == 8
    assert random_drafter(True, shift_label=False).num_depths == 7
    assert random_drafter(False).num_depths == 7
    d = random_drafter(True, shift_label=True)
    tiny_target.set_taps(d.target_layer_ids)
    d.reset()
    d.add_context(tiny_target.prefill([1, 5, 6]).features, 0)
    out = d.draft(7, 3, tiny_target)
    assert out.base_logits.shape == (8, 96) and out.hidden.shape == (8, 64)


def test_gru_step_equals_torch_gru():
    torch.manual_seed(0)
    head = DominoHead(drafter_config(True))
    x = torch.randn(1, 6, 64)
    ref, _ = head.prefix_gru(x)
    state = head.zero_state(1)
    for t in range(6):
        state = head.gru_step(state, x[:, t])
        assert torch.allclose(state, ref[:, t], atol=1e-6)
    assert torch.allclose(head.teacher_forced_states(x), ref)


def test_candidate_correction_is_the_full_correction_restricted():
    torch.manual_seed(0)
    head = DominoHead(drafter_config(True))
    h, s = torch.randn(3, 64), torch.randn(3, 24)
    full = head.correction(h, s)
    cand = torch.tensor([5, 17, 0, 95])
    assert torch.allclose(head.correction(h, s, cand), full[:, cand], atol=1e-6)
    per_row = torch.tensor([[1, 2], [3, 4], [90, 91]])
    assert torch.allclose(head.correction(h, s, per_row), torch.gather(full, 1, per_row), atol=1e-6)


def test_context_cache_equals_recomputing_everything(tiny_target):
    """Appending context round by round = projecting the whole context at once."""
    d = random_drafter(False)
    tiny_target.set_taps(d.target_layer_ids)
    feats = tiny_target.prefill(list(range(1, 12))).features
    d.reset()
    d.add_context(feats, 0)
    once = d.draft(20, 11, tiny_target).base_logits
    d.reset()
    d.add_context(feats[:5], 0)
    d.add_context(feats[5:9], 5)
    d.add_context(feats[9:], 9)
    assert torch.allclose(d.draft(20, 11, tiny_target).base_logits, once, rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError):
        d.add_context(feats[:2], 3)


def test_block_attention_is_bidirectional(tiny_target):
    """Changing a later block token changes earlier positions' outputs (no causal mask)."""
    d = random_drafter(False)
    tiny_target.set_taps(d.target_layer_ids)
    d.reset()
    d.add_context(tiny_target.prefill([1, 5, 6]).features, 0)
    h1 = d.block_hidden(7, 3, tiny_target)
    d.config.mask_token_id = 4
    h2 = d.block_hidden(7, 3, tiny_target)
    d.config.mask_token_id = 3
    assert not torch.allclose(h1[0], h2[0])




@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_gqa_draft_equals_the_repeated_heads_path(tiny_target, dtype):
    """A draft (no mask) packs each group of query heads onto its key/value head; an all-True mask
    takes the reference path, which repeats the key/value heads: the same outputs."""
    d = random_drafter(False, layers=2).to(dtype=dtype)
    assert d.config.num_attention_heads > d.config.num_key_value_heads
    tiny_target.set_taps(d.target_layer_ids)
    d.reset()
    d.add_context(tiny_target.prefill(list(range(1, 14))).features, 0)
    b = d.config.block_size
    emb = tiny_target.embed(torch.tensor([7] + [d.config.mask_token_id] * (b - 1)))[None].to(dtype)
    pos = torch.arange(13, 13 + b)[None]
    with torch.inference_mode():
        packed = d.backbone(emb, pos, d._ctx_kv)
        repeated = d.backbone(emb, pos, d._ctx_kv, mask=torch.ones(1, 1, b, 13 + b, dtype=torch.bool))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(packed.float(), repeated.float(), rtol=tol, atol=tol)
@pytest.mark.parametrize("mutate, match", [
    (lambda p: (p / "model.safetensors").write_bytes(b"not a safetensors file"), "corrupt"),
    (lambda p: (p / "model.safetensors").unlink(), "no model.safetensors"),
    (lambda p: (p / "config.json").write_text("{broken"), "not valid JSON"),
    (lambda p: (p / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]})), "architectures"),
])
def test_broken_checkpoints_get_clear_errors(ckpt_dir, mutate, match):
    path, _ = ckpt_dir(True)
    mutate(path)
    with pytest.raises(DrafterLoadError, match=match):
        dt.load_drafter(str(path))


def test_truncated_weights_are_rejected(ckpt_dir):
    path, _ = ckpt_dir(True)
    cfg = raw_config(path)
    cfg["dflash_config"]["gru_hidden_dim"] = 32          # config no longer matches the tensors
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DrafterLoadError, match="shape"):
        dt.load_drafter(str(path))


@pytest.mark.parametrize("field, value, match", [
    ("hidden_size", 128, "hidden size"),
    ("mask_token_id", 500, "mask_token_id"),
    ("vocab_size", 100, "vocabulary"),
])
def test_drafter_that_does_not_fit(tiny_target, field, value, match):
    cfg = drafter_config(True)
    setattr(cfg, field, value)
    from dominotree.drafters import check_fits
    with pytest.raises(DrafterLoadError, match=match):
        check_fits(cfg, tiny_target)


def test_unknown_drafter_name():
    with pytest.raises(dt.ModelNotFoundError, match="unknown drafter"):
        dt.load_drafter("nope-drafter")


def _domino_draft(tiny_target, seed):
    """A random Domino drafter and its draft after the context [1, 5, 6, 7], root 9."""
    d = random_drafter(True, seed=seed)
    tiny_target.set_taps(d.target_layer_ids)
    d.reset()
    d.add_context(tiny_target.prefill([1, 5, 6, 7]).features, 0)
    return d, d.draft(9, 4, tiny_target)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("topm", [2, 96])
def test_domino_chain_is_the_full_vocabulary_argmax(tiny_target, seed, topm):
    """The chain is the full-vocabulary argmax of the corrected logits: compare with a plain loop."""
    d, out = _domino_draft(tiny_target, seed)
    tokens, _ = d.chain(out, 9, tiny_target, d.num_depths, topm=topm)
    state = d.head.gru_step(d.head.zero_state(1), tiny_target.embed(torch.tensor([9])))
    ref = []
    for k in range(1, d.num_depths + 1):
        logits = out.base_logits[k - 1]
        if k > d.prefix_len:
            logits = logits + d.head.correction(out.hidden[k - 1][None], state)[0]
        ref.append(int(torch.argmax(logits)))
        state = d.head.gru_step(state, tiny_target.embed(torch.tensor([ref[-1]])))
    assert tokens == ref


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("topm", [2, 96])
def test_domino_chain_pruned_equals_full_product(tiny_target, seed, topm):
    """The pruned argmax (only tokens that can win are scored) gives the reference chain exactly."""
    d, out = _domino_draft(tiny_target, seed)
    assert d.chain(out, 9, tiny_target, d.num_depths, topm=topm) == \
        d.chain(out, 9, tiny_target, d.num_depths, topm=topm, pruned=False)


@pytest.mark.parametrize("seed", range(40))
def test_corrected_argmax_is_exact_and_prunes(seed):
    from dominotree.drafters.domino import W2Bound, corrected_argmax
    g = torch.Generator().manual_seed(seed)
    V, r, M = 3000, 16, 8
    w2 = torch.randn(V, r, generator=g) * 0.1
    w2 += torch.randn(V, 1, generator=g) * torch.randn(1, r, generator=g)   # a dominant direction, as trained heads have
    w2[7] = w2[5]                                      # a duplicate row: exact ties must break low
    base = torch.randn(V, generator=g) * (1 + seed % 4)
    base[5] = base[7] = base.max() + 0.5 * (seed % 3)
    z = torch.randn(r, generator=g) * (0.3 if seed % 2 else 4.0)
    cand = torch.topk(base, M).indices
    if seed % 5 == 0:                                  # the winner lies outside the candidates
        outside = int(torch.topk(base, M + 1).indices[-1])
        w2[outside] = z / z.norm() * 50
    full = base + w2 @ z
    tok, corr_c, scored = corrected_argmax(base, z, W2Bound(w2, k=4), cand)
    assert tok == int(torch.argmax(full))
    assert torch.allclose(corr_c, full[cand])
    if seed % 2 and seed % 5:                          # small corrections: almost nothing scored
        assert scored < V // 10


@pytest.mark.parametrize("k", [0, 3, 16])
def test_w2_bound_is_an_upper_bound(k):
    from dominotree.drafters.domino import W2Bound
    g = torch.Generator().manual_seed(k)
    w2 = torch.randn(500, 12, generator=g) + 3 * torch.randn(500, 1, generator=g) * torch.randn(1, 12, generator=g)
    bound = W2Bound(w2, k=k)
    for _ in range(20):
        z = torch.randn(12, generator=g) * 5
        exact = w2 @ z
        gap = bound.upper(z) - exact
        # float32 rounding, relative to the logits' size (corrected_argmax gives the same slack)
        assert (gap >= -1e-4 * (1 + exact.abs())).all()
    if k == 12 or k == 16:                             # the full basis: the bound is exact
        assert gap.abs().max() < 1e-3


def test_default_dtypes_follow_the_machine_and_the_target(tmp_path, tiny_llama_dir, monkeypatch):
    """Unless told, a target loads in machine.default_dtype (fp32 on a CPU without bf16 hardware)
    and a drafter in its target's dtype (without a target: its checkpoint's, upcast to fp32 on
    such a CPU); an unknown dtype name is a clear error."""
    import dominotree.drafters as drafters
    import dominotree.target as target_module
    from dominotree.drafters import save_checkpoint
    save_checkpoint(random_drafter(domino=True, seed=5), tmp_path / "d", dtype=torch.bfloat16)
    for machine_dtype in (torch.bfloat16, torch.float32):
        monkeypatch.setattr(target_module, "default_dtype", lambda device="cpu", d=machine_dtype: d)
        monkeypatch.setattr(drafters, "default_dtype", lambda device="cpu", d=machine_dtype: d)
        target = dt.load_target(str(tiny_llama_dir))
        assert target.dtype == machine_dtype and target.packed
        assert dt.load_drafter(str(tmp_path / "d"), target=target).dtype == machine_dtype
        assert dt.load_drafter(str(tmp_path / "d")).dtype == machine_dtype
        assert dt.load_drafter(str(tmp_path / "d"), dtype="bf16").dtype == torch.bfloat16
    fp32_target = dt.load_target(str(tiny_llama_dir), dtype="fp32")
    assert dt.load_drafter(str(tmp_path / "d"), target=fp32_target).dtype == torch.float32
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        dt.load_target(str(tiny_llama_dir), dtype="int8")
    with pytest.raises(ValueError, match="unknown dtype"):
        dt.load_drafter(str(tmp_path / "d"), dtype="half-ish")
