"""Target features for training, computed once and cached on disk (bf16 bits in a uint16 memmap).

Drafter training reads the same features every epoch; recomputing them would cost a full target
forward pass per step, caching costs one pass in total."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .data import read_shards


class FeatureStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        meta = json.loads((self.root / "features.json").read_text())
        self.layer_ids = meta["layer_ids"]
        self.dim = meta["dim"]
        self.offsets = np.array(meta["offsets"], dtype=np.int64)
        self.prompt_lens = np.array(meta["prompt_lens"], dtype=np.int64)
        self.tokens = np.load(self.root / "tokens.npy", mmap_mode="r")
        total = int(self.offsets[-1])
        self.feats = np.memmap(self.root / "features.u16", dtype=np.uint16, mode="r", shape=(total, self.dim))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def sequence(self, i: int):
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        toks = torch.from_numpy(np.asarray(self.tokens[a:b], dtype=np.int64))
        feats = torch.from_numpy(np.array(self.feats[a:b])).view(torch.bfloat16)
        return toks, feats, int(self.prompt_lens[i])


@torch.inference_mode()
def build_feature_store(target, data_dir: Path, out: Path, layer_ids: list[int], max_len: int = 768,
                        batch_tokens: int = 4096) -> FeatureStore:
    """Run the target over every (prompt + response), keep the tapped layers' outputs."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    seqs = [s for s in read_shards(data_dir) if len(s.tokens) - s.prompt_len >= 2]
    seqs = [type(s)(s.tokens[:max_len], s.prompt_len, s.source) for s in seqs if s.prompt_len < max_len - 2]
    lens = np.array([len(s.tokens) for s in seqs])
    offsets = np.concatenate([[0], np.cumsum(lens)])
    dim = len(layer_ids) * target.hidden_size
    feats = np.memmap(out / "features.u16", dtype=np.uint16, mode="w+", shape=(int(offsets[-1]), dim))
    np.save(out / "tokens.npy", np.concatenate([s.tokens for s in seqs]).astype(np.int32))
    order = np.argsort(lens)
    batches, cur, width = [], [], 0
    for i in order:                      # similar lengths together: little padding
        width = max(width, lens[i])
        if cur and width * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, width = [], lens[i]
        cur.append(i)
    if cur:
        batches.append(cur)
    base = target.model.base_model
    for batch in tqdm(batches, desc="target features"):
        w = int(max(lens[i] for i in batch))
        ids = torch.zeros(len(batch), w, dtype=torch.long)
        for r, i in enumerate(batch):
            ids[r, :lens[i]] = torch.from_numpy(seqs[i].tokens)
        hs = base(input_ids=ids, output_hidden_states=True).hidden_states   # right padding: causal, harmless
        f = torch.cat([hs[l + 1] for l in layer_ids], -1).to(torch.bfloat16)
        for r, i in enumerate(batch):
            feats[offsets[i]:offsets[i + 1]] = f[r, :lens[i]].view(torch.uint16).numpy()
    feats.flush()
    (out / "features.json").write_text(json.dumps({
        "layer_ids": layer_ids, "dim": dim, "offsets": offsets.tolist(),
        "prompt_lens": [s.prompt_len for s in seqs], "target": target.name}))
    return FeatureStore(out)
