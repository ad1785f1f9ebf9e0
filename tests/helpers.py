"""Scripted drafters: proposals chosen by the test (oracle, partly right), real drafter plumbing."""
from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import dominotree as dt
from dominotree.drafters import DraftOutput


def reference_sequence(target, prompt, n):
    r = dt.generate(target, None, prompt, method="ar", max_new_tokens=n)
    return list(prompt) + r.token_ids, r


class ScriptedDrafter:
    """Wraps a real drafter (context cache, head, config) but replaces its base logits.

    At position `start` the oracle proposes ref[start + d] at depth d; with `wrong_rate` > 0 a
    deterministic pseudo-random subset of depths proposes another token instead. The second
    and third choices are other tokens, so trees get real siblings."""

    def __init__(self, inner, ref: list[int], wrong_rate: float = 0.0, seed: int = 0, margin: float = 8.0):
        self.inner, self.ref, self.wrong_rate, self.seed, self.margin = inner, ref, wrong_rate, seed, margin
        self.config = inner.config
        self.name = "scripted"
        if hasattr(inner, "head"):
            self.head = inner.head
        self.calls = 0

    def __getattr__(self, item):
        return getattr(self.inner, item)

    def draft(self, root, start, target, depths=None, vocab=None):
        self.calls += 1
        out = self.inner.draft(root, start, target, depths, vocab)  # exercises the real backbone path
        D, V = out.base_logits.shape
        g = torch.Generator().manual_seed(self.seed * 7919 + start)
        logits = torch.randn(D, V, generator=g)
        for d in range(1, D + 1):
            pos = start + d
            tok = self.ref[pos] if pos < len(self.ref) else int(torch.randint(0, V, (1,), generator=g))
            if self.wrong_rate and float(torch.rand(1, generator=g)) < self.wrong_rate:
                tok = (tok + 1 + int(torch.randint(0, V - 1, (1,), generator=g))) % V
            logits[d - 1, tok] += self.margin
        return DraftOutput(out.hidden, restrict(logits, vocab))


def restrict(logits, vocab):
    """-inf outside a draft vocabulary (draft_vocab.DraftVocab), as the real drafter's LM head gives."""
    if vocab is None:
        return logits
    out = torch.full_like(logits, float("-inf"))
    out[:, vocab.ids] = logits[:, vocab.ids]
    return out


def zero_head(drafter):
    """Make the Domino correction vanish (so scripted base logits decide)."""
    with torch.no_grad():
        drafter.head.embed_proj[2].weight.zero_()
    return drafter


class MirrorDrafter(ScriptedDrafter):
    """Proposes the target's own next-token logits along its greedy continuation of the real
    history (so siblings are the target's genuine alternatives). Drive it with `run_mirror`."""

    def __init__(self, inner, target, depth: int | None = None):
        super().__init__(inner, [])
        self.depth = depth   # compute only this many real depths (the rest repeat the last row)
        self.target_model = target.model
        self.history: list[int] = []

    def draft(self, root, start, target, depths=None, vocab=None):
        out = self.inner.draft(root, start, target, depths, vocab)
        assert self.history and self.history[-1] == root and len(self.history) == start + 1
        seq, rows = list(self.history), []
        with torch.inference_mode():
            for d in range(out.base_logits.shape[0]):
                if self.depth is not None and d >= self.depth:
                    rows.append(rows[-1])
                    continue
                logits = self.target_model(input_ids=torch.tensor([seq])).logits[0, -1].float()
                rows.append(logits)
                seq.append(int(logits.argmax()))
        return DraftOutput(out.hidden, restrict(torch.stack(rows), vocab))


def run_mirror(target, drafter: MirrorDrafter, prompt, **kw):
    stream = dt.stream_generate(target, drafter, prompt, **kw)
    drafter.history = list(prompt)
    for event in stream:
        drafter.history.extend(event.token_ids)
    return stream.result


def byte_level_tokenizer(vocab_size=400) -> Tokenizer:
    """A byte-level BPE (as GPT-2, Llama 3, Qwen, SmolLM2 use) trained on a few sentences: emoji and
    CJK characters stay split across several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(["Hello world, the answer is here.", "def f(x): return x",
                             "Grüße aus Köln! 你好，世界。こんにちは 🙂🚀 naïve café"], trainer)
    return tok
