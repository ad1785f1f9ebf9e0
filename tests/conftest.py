"""Tiny models built from configs (float32, no downloads) and the drafters that go with them."""
from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

import dominotree as dt
from dominotree.drafters import DrafterConfig, build_drafter, save_checkpoint

VOCAB = 96
torch.set_num_threads(1)   # tiny models: one thread is fastest and leaves a core to spare
EOS = 2
CHAT = ("{% for m in messages %}<s>{{ m['role'] }} {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant{% endif %}")


def make_tokenizer() -> PreTrainedTokenizerFast:
    words = ["<unk>", "<s>", "</s>", "<mask>"] + [f"w{i}" for i in range(VOCAB - 4)]
    words[4:10] = ["user", "assistant", "system", "hello", "world", "the"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders
    tok.decoder = decoders.WordPiece(prefix="##")   # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")
    fast.chat_template = CHAT
    return fast


def _save(model, path):
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


def tiny_config_kwargs(seed_layers=4):
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=seed_layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                bos_token_id=1, eos_token_id=EOS, pad_token_id=EOS, tie_word_embeddings=False,
                rope_theta=10000.0)


def build_tiny(model_cls, config_cls, seed, path):
    """A tiny random HF model (and the word-level tokenizer) saved as a local model directory."""
    torch.manual_seed(seed)
    model = model_cls(config_cls(**tiny_config_kwargs()))
    _sharpen(model)
    return _save(model, path)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return build_tiny(LlamaForCausalLM, LlamaConfig, 0, tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    return build_tiny(Qwen3ForCausalLM, Qwen3Config, 1, tmp_path_factory.mktemp("tiny_qwen3"))


def _sharpen(model):
    """Random tiny models are near-uniform; a unit-scale embedding and a sharper LM head give
    varied, peaked (but not one-hot) next-token distributions that reach EOS now and then."""
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0, 1.0)
        model.get_output_embeddings().weight.normal_(0, 20.0 / 64 ** 0.5)


@pytest.fixture(scope="session")
def tiny_target(tiny_llama_dir):
    return dt.load_target(str(tiny_llama_dir), dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_qwen3_target(tiny_qwen3_dir):
    return dt.load_target(str(tiny_qwen3_dir), dtype=torch.float32)


def drafter_config(domino: bool, block_size=8, shift_label=None, layers=1) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=VOCAB, num_target_layers=4, target_layer_ids=[1, 2],
        mask_token_id=3, block_size=block_size, rope_theta=10000.0, max_position_embeddings=256,
        projector_type="domino" if domino else None, emb_dim=16, gru_hidden_dim=24, pure_draft_prefix_len=1,
        shift_label=domino if shift_label is None else shift_label)


def random_drafter(domino: bool, seed=0, **kw):
    torch.manual_seed(seed)
    d = build_drafter(drafter_config(domino, **kw), "random")
    with torch.no_grad():
        for p in list(d.backbone.parameters()) + (list(d.head.parameters()) if domino else []):
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return d


@pytest.fixture
def ckpt_dir(tmp_path):
    def write(domino: bool, **kw):
        d = random_drafter(domino, **kw)
        path = tmp_path / ("domino" if domino else "dflash")
        save_checkpoint(d, path, dtype=torch.float32)
        return path, d
    return write


def raw_config(path):
    return json.loads((path / "config.json").read_text())
