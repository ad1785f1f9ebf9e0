"""Reduced draft vocabulary: the ranking, the subset LM head against the full one, generation that
drafts only the subset and still emits plain decoding's tokens (and the target's distribution at
T = 1), and clear errors for bad options."""
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dominotree as dt
from conftest import VOCAB, random_drafter
from dominotree.draft_vocab import DraftVocab, draft_vocab_for, token_ranking, top_token_ids
from dominotree.drafters import DraftOutput
from dominotree.trees.fast import GruInputs
from dominotree.engine import GenerationStream
from dominotree.packed import packing_available
from dominotree.train.data import Sequence, write_shard
from helpers import reference_sequence
from test_verify import exact_joint, sample_first_tokens, tv_and_bound

PROMPT = [1, 11, 12, 13]


def shard_dir(path, responses, prompt=(1, 2)):
    path.mkdir(parents=True, exist_ok=True)
    write_shard(path / "shard_00000.npz",
                [Sequence(np.array(list(prompt) + list(r)), len(prompt), "test") for r in responses])
    token_ranking.cache_clear()
    return str(path)


def test_ranking_counts_responses_only_and_breaks_ties_by_id(tmp_path):
    d = shard_dir(tmp_path / "s", [[7, 7, 7, 5, 5, 9], [9, 5, 30]], prompt=(30, 30, 30, 30))
    ranking = token_ranking(d, 40)
    # 5: 3, 7: 3, 9: 2, 30: 1 (its prompt copies do not count), then every unseen id in id order
    assert ranking[:4].tolist() == [5, 7, 9, 30]
    assert ranking[4:7].tolist() == [0, 1, 2] and sorted(ranking.tolist()) == list(range(40))
    assert top_token_ids(ranking, 2, always={2}).tolist() == [2, 5, 7]
    assert top_token_ids(ranking, 3, always={7}).tolist() == [5, 7, 9]
    with pytest.raises(ValueError, match="another tokenizer"):
        token_ranking(d, 20)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_subset_logits_equal_the_full_head_on_the_subset(dtype):
    if dtype == torch.bfloat16 and not packing_available():
        pytest.skip("no oneDNN packing in this torch build")
    torch.manual_seed(0)
    head = nn.Linear(32, 200, bias=False, dtype=dtype)
    ids = torch.tensor([0, 3, 17, 64, 199])
    vocab = DraftVocab(head, ids)
    hidden = torch.randn(6, 32, dtype=dtype)
    out = vocab.logits(hidden)
    assert out.shape == (6, 200) and out.dtype == torch.float32
    torch.testing.assert_close(out[:, ids], F.linear(hidden, head.weight[ids]).float())
    rest = torch.ones(200, dtype=torch.bool)
    rest[ids] = False
    assert torch.isneginf(out[:, rest]).all()
    assert out.argmax(-1).tolist() == ids[F.linear(hidden, head.weight[ids]).float().argmax(-1)].tolist()


def recorded_trees(target, drafter, prompt, **kw):
    """Generate, keeping every tree the proposer built."""
    stream = GenerationStream(target, drafter, prompt, dt.SpecConfig.from_kwargs(**kw))
    inner, trees = stream.proposer, []

    def record(*args):
        tree, timing, info = inner(*args)
        trees.append(tree)
        return tree, timing, info

    stream.proposer = record
    for _ in stream:
        pass
    return stream.result, trees


@pytest.mark.parametrize("method", ["dflash", "domino", "ddtree", "dominotree"])
def test_generation_drafts_only_the_subset_and_stays_lossless(tiny_target, tmp_path, method):
    _, plain = reference_sequence(tiny_target, PROMPT, 30)
    # the ranking favours the odd ids: the 48 most frequent are the odd ones
    source = shard_dir(tmp_path / "s", [list(range(1, VOCAB, 2)) * 3 + list(range(0, VOCAB, 2))])
    subset = set(range(1, VOCAB, 2)) | tiny_target.eos_token_ids
    drafter = random_drafter(method in ("domino", "dominotree"), seed=5)
    kw = dict(method=method, max_new_tokens=30, budget=10, corr_topm=16)
    full, full_trees = recorded_trees(tiny_target, drafter, PROMPT, **kw)
    out, trees = recorded_trees(tiny_target, drafter, PROMPT, draft_vocab=48, draft_vocab_source=source, **kw)
    assert out.token_ids == plain.token_ids == full.token_ids
    drafted = [int(t) for tree in trees for t in tree.tokens[1:]]
    assert drafted and set(drafted) <= subset
    # the control: the full vocabulary drafts even ids too, so the check above can fail
    assert any(int(t) not in subset for tree in full_trees for t in tree.tokens[1:])


def test_tree_builders_read_compact_rows_and_only_chains_widen_them(tiny_target, tmp_path, monkeypatch):
    """A draft over a draft vocabulary keeps its logits compact: DDTree and DominoTree build from
    them and never make the [D, V] rows; the DFlash chain reads those (the control) and gets the
    compact scores widened with -inf off the subset. DominoTree fills its GRU input table for the
    subset before the first round."""
    source = shard_dir(tmp_path / "s", [list(range(1, VOCAB, 2)) * 3])
    widened, expand = [], DraftVocab.expand
    monkeypatch.setattr(DraftVocab, "expand", lambda self, c: widened.append(c.shape) or expand(self, c))
    fills, fill = [], GruInputs.fill
    monkeypatch.setattr(GruInputs, "fill", lambda self, tokens: fills.append(list(tokens)) or fill(self, tokens))
    kw = dict(max_new_tokens=12, budget=8, corr_topm=16, draft_vocab=48, draft_vocab_source=source)
    domino = random_drafter(True, seed=5)
    for method in ("ddtree", "dominotree"):
        dt.generate(tiny_target, domino, PROMPT, method=method, **kw)
    assert widened == []
    drafter = random_drafter(False, seed=5)
    dt.generate(tiny_target, drafter, PROMPT, method="dflash", **kw)
    assert widened
    assert fills[0] == draft_vocab_for(tiny_target, 48, source).ids.tolist()   # GRU table warmed before round 1


def test_a_draft_output_widens_its_compact_scores_when_read():
    torch.manual_seed(0)
    vocab = DraftVocab(nn.Linear(32, 200, bias=False), torch.tensor([0, 3, 17, 64, 199]))
    rows, hidden = torch.randn(3, 32), torch.zeros(3, 8)
    out = DraftOutput(hidden, vocab=vocab, vocab_logits=vocab.compact(rows))
    logits, ids = out.scores()
    assert torch.equal(ids, vocab.ids) and torch.equal(logits, vocab.compact(rows))
    assert torch.equal(out.base_logits, vocab.logits(rows))
    plain = DraftOutput(hidden, vocab.logits(rows))
    assert plain.scores()[1] is None and plain.scores()[0] is plain.base_logits
    for bad in (dict(), dict(base_logits=logits, vocab=vocab, vocab_logits=logits), dict(vocab_logits=logits)):
        with pytest.raises(ValueError, match="either base_logits or a vocab"):
            DraftOutput(hidden, **bad)


def test_draft_vocab_keeps_the_target_distribution_at_t1(tiny_target, tmp_path):
    """Mirror drafter (the target's own alternatives) restricted to a subset that holds the target's
    likely tokens and half of the rest, so restricted drafts get accepted and some are drafted out."""
    n, steps = 1000, 3
    ref, _ = reference_sequence(tiny_target, PROMPT, 8)
    source = shard_dir(tmp_path / "s", [ref[len(PROMPT):] * 4 + list(range(0, VOCAB, 2))])
    exact = exact_joint(tiny_target, PROMPT, steps, 1.0, 0, 1.0)
    stats = []
    counts = sample_first_tokens(tiny_target, "dominotree", 1.0, 0, 1.0, n, stats=stats, corr_topm=8,
                                 draft_vocab=48, draft_vocab_source=source)
    assert sum(sum(s["accepted_per_round"]) for s in stats) > n, "restricted drafts were rarely accepted"
    tv, bound = tv_and_bound(counts, exact, n)
    assert tv < bound, f"TV {tv:.3f} >= bound {bound:.3f}"


def test_the_subset_is_built_once_per_target_size_and_source(tiny_target, tmp_path):
    source = shard_dir(tmp_path / "s", [[5, 6, 7]])
    a = draft_vocab_for(tiny_target, 20, source)
    assert draft_vocab_for(tiny_target, 20, source) is a
    assert draft_vocab_for(tiny_target, 21, source) is not a
    assert len(a) == len(set(a.ids.tolist())) >= 20 and {5, 6, 7} <= set(a.ids.tolist())


def test_bad_draft_vocab_options_are_rejected(tiny_target, tmp_path):
    with pytest.raises(ValueError, match="draft_vocab must be an integer >= 0"):
        dt.SpecConfig(method="dominotree", draft_vocab=-1)
    with pytest.raises(ValueError, match="method 'ar' drafts nothing"):
        dt.SpecConfig(method="ar", draft_vocab=1000)
    with pytest.raises(ValueError, match="smaller than the 64 candidates"):
        dt.SpecConfig(method="dominotree", draft_vocab=32)
    drafter = random_drafter(False)
    with pytest.raises(ValueError, match=f"integer in 1..{VOCAB}"):
        dt.generate(tiny_target, drafter, PROMPT, method="ddtree", draft_vocab=VOCAB + 1,
                    draft_vocab_source=shard_dir(tmp_path / "s", [[5]]))
    with pytest.raises(FileNotFoundError, match="draft_vocab_source .* is not a directory"):
        dt.generate(tiny_target, drafter, PROMPT, method="ddtree", draft_vocab=64,
                    draft_vocab_source=str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="give draft_vocab_source a directory"):
        dt.generate(tiny_target, drafter, PROMPT, method="ddtree", draft_vocab=64)   # no train_data for it
    # a failed request leaves the target ready for the next one
    assert dt.generate(tiny_target, drafter, PROMPT, method="ddtree", max_new_tokens=5).token_ids


def test_profile_times_drafts_with_the_draft_vocabulary(tiny_target, tmp_path, monkeypatch):
    from dominotree.trees.caddtree import profile
    drafter = random_drafter(False, seed=1)
    vocab = draft_vocab_for(tiny_target, 64, shard_dir(tmp_path / "s", [[5, 6, 7]]))
    seen, draft = [], drafter.draft

    def spy(*a, **kw):
        seen.append(kw.get("vocab"))
        return draft(*a, **kw)
    monkeypatch.setattr(drafter, "draft", spy)
    cm = profile(tiny_target, drafter, max_nodes=4, contexts=(8,), repeats=2, progress=False, vocab=vocab)
    assert cm.c_draft > 0 and seen and all(v is vocab for v in seen)


def test_the_gru_table_made_in_a_round_can_be_warmed_outside_inference_mode(tiny_target):
    """The benchmark's order: DominoTree over all tokens first (a round, in inference mode, makes
    the drafter's GRU input table), then a request over a draft vocabulary, whose setup warms the
    same table for blocks not computed yet, outside inference mode."""
    drafter = random_drafter(True, seed=5)
    weights, embed = drafter.tree_weights(), tiny_target.model.get_input_embeddings().weight
    with torch.inference_mode():
        first = weights.input_rows(embed, [1, 2]).clone()       # block 0 only
    weights.warm(embed, torch.tensor([40, 70, 95]))              # blocks 1 and 2, outside the mode
    expected = F.linear(embed.detach().float(), weights.w_ih)
    assert torch.allclose(first, expected[[1, 2]])
    assert torch.allclose(weights.input_rows(embed, [40, 95]), expected[[40, 95]])
    assert not weights.inputs.table.requires_grad
