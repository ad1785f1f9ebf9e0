"""BatchDecoder (train/batch_decode.py) writes the tokens the HF model's own decoding writes."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dominotree.train.batch_decode import BatchDecoder


def tiny_llama(seed=0, kv_heads=2):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256,
                      rope_theta=1000.0, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def hf_greedy(model, prompt, n, eos):
    ids = torch.tensor([prompt], device=model.device)
    out = []
    with torch.no_grad():
        for _ in range(n):
            t = int(model(input_ids=ids).logits[0, -1].argmax())
            out.append(t)
            if t in eos:
                break
            ids = torch.cat([ids, torch.tensor([[t]], device=ids.device)], 1)
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA"))])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_greedy_equals_hf_with_left_padding(kv_heads, device):
    model = tiny_llama(kv_heads=kv_heads).to(device)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (5, 1, 12, 7)]
    eos = {3}
    got = BatchDecoder(model).generate(prompts, 20, eos)
    want = [hf_greedy(model, p, 20, eos) for p in prompts]
    assert got == want


def test_stops_at_eos_and_keeps_it():
    model = tiny_llama(seed=3)
    prompt = [5, 6, 7]
    first = hf_greedy(model, prompt, 1, set())[0]
    got = BatchDecoder(model).generate([prompt, [9, 9]], 10, {first})
    assert got[0] == [first]
    assert got[1] == hf_greedy(model, [9, 9], 10, {first})


def test_sampling_follows_the_distribution():
    model = tiny_llama(seed=2)
    dec = BatchDecoder(model)
    prompt = [4, 8, 15]
    with torch.no_grad():
        p = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1] / 0.7, -1)
    g = torch.Generator().manual_seed(0)
    draws = dec.generate([prompt] * 4000, 1, set(), temperature=0.7, generator=g)
    counts = torch.bincount(torch.tensor([d[0] for d in draws]), minlength=97).float()
    top = p.topk(3).indices
    assert torch.allclose(counts[top] / 4000, p[top], atol=0.03)
    greedy = dec.generate([prompt] * 50, 1, set())          # negative control: temperature 0 never varies
    assert len({d[0] for d in greedy}) == 1


def test_rejects_empty_prompt_and_other_architectures():
    model = tiny_llama()
    with pytest.raises(ValueError, match="non-empty"):
        BatchDecoder(model).generate([[1], []], 3, set())
    model.config.model_type = "qwen3"
    with pytest.raises(ValueError, match="Llama"):
        BatchDecoder(model)


@pytest.mark.parametrize("compact_every", [1, 3, 10_000])
def test_finished_rows_leave_the_batch_without_changing_the_others(tiny_llama_dir, compact_every):
    from collections import Counter
    from conftest import EOS, VOCAB
    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(5, VOCAB, (int(n),), generator=g).tolist() for n in torch.randint(1, 9, (24,), generator=g)]
    free = [hf_greedy(model, p, 30, set()) for p in prompts]
    common = Counter(t for f in free for t in f[5:]).most_common(1)[0][0]
    eos = {EOS, common}                               # rows stop at different steps
    want = [hf_greedy(model, p, 30, eos) for p in prompts]
    lengths = sorted(len(w) for w in want)
    assert lengths[len(lengths) // 4] < lengths[-1]     # a quarter stop early: rows leave the batch
    got = BatchDecoder(model).generate(prompts, 30, eos, compact_every=compact_every)
    assert got == want
