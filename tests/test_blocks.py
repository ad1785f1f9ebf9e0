"""Batched block construction (train/blocks.py sample_anchors / blocks_from_anchors) against make_batch."""
import pytest
import torch

from dominotree.train.blocks import blocks_from_anchors, make_batch, sample_anchors


def sequences(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for L, plen in [(30, 5), (9, 6), (20, 3), (7, 5)]:       # the last two rows have fewer choices than anchors
        out.append((torch.randint(20, 90, (L,), generator=g), torch.randn(L, 6, generator=g).bfloat16(), plen))
    return out


def padded(seqs):
    S = max(len(t) for t, _, _ in seqs)
    tokens = torch.zeros(len(seqs), S, dtype=torch.long)
    feats = torch.zeros(len(seqs), S, 6, dtype=torch.bfloat16)
    for i, (t, f, _) in enumerate(seqs):
        tokens[i, :len(t)], feats[i, :len(t)] = t, f
    lens = torch.tensor([len(t) for t, _, _ in seqs])
    return tokens, feats, lens, torch.tensor([p for _, _, p in seqs])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_blocks_from_anchors_equal_make_batch(seed):
    seqs = sequences(seed)
    b, N, D = 4, 5, 4
    ref = make_batch(seqs, b, N, D, 3, torch.Generator().manual_seed(seed))
    anchors = ref.block_pos[:, ::b]
    valid = anchors > 0                  # every prompt is non-empty, so a real anchor is never position 0
    tokens, feats, lens, _ = padded(seqs)
    got = blocks_from_anchors(tokens, lens, feats, anchors, valid, b, D, 3)
    for name in ("ctx_feats", "ctx_pos", "block_ids", "block_pos", "mask", "labels", "truth"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name


def test_sample_anchors_are_distinct_sorted_response_positions():
    seqs = sequences()
    _, _, lens, plens = padded(seqs)
    seen = torch.zeros(len(seqs), int(lens.max()))
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        anchors, valid = sample_anchors(lens, plens, 5, g)
        for i in range(len(seqs)):
            a = anchors[i][valid[i]]
            choices = int(lens[i] - 1 - plens[i])
            assert len(a) == min(5, choices)                 # as many as there are, up to N
            assert torch.all(a[1:] > a[:-1])                  # distinct and sorted
            assert torch.all((a >= plens[i]) & (a < lens[i] - 1))
            seen[i, a] += 1
    # uniform over the choices: row 0 has 24 choices, 5 drawn per call -> 62.5 expected per position
    row0 = seen[0, 5:29]
    assert row0.min() > 35 and row0.max() < 95
    assert seen[0, :5].sum() == 0 and seen[0, 29:].sum() == 0
