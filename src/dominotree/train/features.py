"""Target features for training, computed once and cached on disk (bf16 bits in a uint16 memmap).

Drafter training reads the same features every epoch; recomputing them would cost a full target
forward pass per step, caching costs one pass in total."""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .data import read_shards


class FeatureStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        if not (self.root / "features.json").is_file():
            raise FileNotFoundError(f"no feature store in {self.root}: `dominotree train features` writes it "
                                    f"(after `dominotree train data`)")
        meta = json.loads((self.root / "features.json").read_text())
        self.layer_ids = meta["layer_ids"]
        self.target = meta.get("target")
        self.target_dtype = meta.get("target_dtype", "torch.bfloat16")   # stores older than the field: bf16
        self.dim = meta["dim"]
        self.offsets = np.array(meta["offsets"], dtype=np.int64)
        self.prompt_lens = np.array(meta["prompt_lens"], dtype=np.int64)
        self.tokens = np.load(self.root / "tokens.npy", mmap_mode="r")
        total = int(self.offsets[-1])
        self.feats = np.memmap(self.root / "features.u16", dtype=np.uint16, mode="r", shape=(total, self.dim))
        # optional: the target's top-k next-token predictions per position (build_target_topk)
        has_topk = (self.root / "topk_ids.npy").exists()
        self.topk_ids = np.load(self.root / "topk_ids.npy", mmap_mode="r") if has_topk else None
        self.topk_logp = np.load(self.root / "topk_logp.npy", mmap_mode="r") if has_topk else None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def sequence(self, i: int, columns: np.ndarray | None = None):
        """(tokens, features, prompt length) of sequence i; `columns` picks feature columns (taps)."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        toks = torch.from_numpy(np.asarray(self.tokens[a:b], dtype=np.int64))
        rows = self.feats[a:b]
        feats = torch.from_numpy(np.array(rows if columns is None else rows[:, columns])).view(torch.bfloat16)
        return toks, feats, int(self.prompt_lens[i])

    def topk(self, i: int):
        """The target's top-k (ids [L, k], log-probs [L, k]) for the token after each position of sequence i."""
        if self.topk_ids is None:
            raise ValueError(f"{self.root} has no target top-k: run `dominotree train features --topk K`")
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return (torch.from_numpy(np.asarray(self.topk_ids[a:b], dtype=np.int64)),
                torch.from_numpy(np.asarray(self.topk_logp[a:b], dtype=np.float32)))


def length_batches(lens: np.ndarray, batch_tokens: int) -> list[list[int]]:
    """Sequence indices grouped by similar length (little padding), at most ~batch_tokens per group."""
    batches, cur, width = [], [], 0
    for i in np.argsort(lens):
        width = max(width, lens[i])
        if cur and width * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, width = [], lens[i]
        cur.append(int(i))
    if cur:
        batches.append(cur)
    return batches


class TopkWriter:
    """The top-k arrays of a store, written under temporary names and renamed when complete."""

    def __init__(self, root: Path, total: int, k: int):
        self.root = Path(root)
        self.ids = self._open("topk_ids", np.int32, (total, k))
        self.logp = self._open("topk_logp", np.float16, (total, k))

    def _open(self, name: str, dtype, shape):
        """The temporary array, reopened if an unfinished pass left one of this shape, else new."""
        path = self.root / f"{name}.tmp.npy"
        if path.exists():
            arr = np.lib.format.open_memmap(path, mode="r+")
            if arr.shape == shape and arr.dtype == dtype:
                return arr
            del arr
        return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)

    def flush(self) -> None:
        self.ids.flush(); self.logp.flush()

    def write(self, start: int, top, row: int, n: int) -> None:
        self.ids[start:start + n] = top.indices[row, :n].numpy()
        self.logp[start:start + n] = top.values[row, :n].numpy()

    def close(self) -> None:
        self.flush()
        del self.ids, self.logp
        for name in ("topk_ids", "topk_logp"):
            (self.root / f"{name}.tmp.npy").rename(self.root / f"{name}.npy")


@torch.inference_mode()
def build_target_topk(target, store: FeatureStore, k: int = 8, batch_tokens: int = 4096) -> FeatureStore:
    """Add the target's top-k next-token log-probs at every position of a feature store: soft labels
    for distillation, and the target's own greedy choice where a response was sampled."""
    if k < 1:
        raise ValueError(f"the top-k needs k >= 1, got {k}")
    lens = np.diff(store.offsets)
    writer = TopkWriter(store.root, int(store.offsets[-1]), k)
    for batch in tqdm(length_batches(lens, batch_tokens), desc="target top-k"):
        w = int(max(lens[i] for i in batch))
        ids = torch.zeros(len(batch), w, dtype=torch.long)
        for r, i in enumerate(batch):
            a = int(store.offsets[i])
            ids[r, :lens[i]] = torch.from_numpy(np.asarray(store.tokens[a:a + lens[i]], dtype=np.int64))
        top = target_topk(target, target.model.base_model(input_ids=ids).last_hidden_state, k)
        for r, i in enumerate(batch):
            writer.write(int(store.offsets[i]), top, r, int(lens[i]))
    writer.close()
    return FeatureStore(store.root)


def target_topk(target, last_hidden: torch.Tensor, k: int):
    """Top-k of the target's next-token log-probs from its final (normed) hidden states."""
    logits = target.model.get_output_embeddings()(last_hidden).float()
    return torch.log_softmax(logits, -1).topk(k, -1)


def _reusable_prefix(out: Path, tokens: np.ndarray, offsets: np.ndarray, layer_ids, topk: int,
                     target_name: str, target_dtype: str) -> "FeatureStore | None":
    """The existing store at `out` if it holds leading sequences of this exact request (same target
    and dtype, taps, top-k, and the same tokens for those sequences); None if there is none or it
    does not fit."""
    if not (out / "features.json").exists():
        return None
    old = FeatureStore(out)
    old_k = 0 if old.topk_ids is None else old.topk_ids.shape[1]
    n = len(old)
    if (old.layer_ids != list(layer_ids) or old.target != target_name or old_k != topk or old.target_dtype != target_dtype
            or n > len(offsets) - 1 or not np.array_equal(old.offsets, offsets[:n + 1])
            or not np.array_equal(np.asarray(old.tokens), tokens[:old.offsets[-1]])):
        return None
    return old


@torch.inference_mode()
def build_feature_store(target, data_dir: Path, out: Path, layer_ids: list[int], max_len: int = 768,
                        batch_tokens: int = 4096, topk: int = 0, time_limit_s: float | None = None,
                        save_every_s: float = 60.0) -> FeatureStore | None:
    """Run the target over every (prompt + response), keep the tapped layers' outputs (and, with
    topk > 0, the target's top-k next-token log-probs, in the same pass).

    When the data grew (more shards) and `out` holds the store of its first sequences, only the new
    sequences are computed; the store stays readable as the old one until features.json is rewritten.
    The pass is resumable: every `save_every_s` the written rows are flushed and the finished
    sequences recorded (progress.npy, with the pass it belongs to in progress.json), so a pass that
    was stopped, or ran into `time_limit_s` (no batch starts after it), continues where it
    stopped when called again with the same request. Returns None while the pass is unfinished."""
    bad = [l for l in layer_ids if isinstance(l, bool) or not isinstance(l, (int, np.integer))
           or not 0 <= l < target.num_layers]
    if bad or not layer_ids or len(set(layer_ids)) != len(layer_ids):
        raise ValueError(f"layer_ids must be distinct target layers 0..{target.num_layers - 1}, got {list(layer_ids)}")
    if topk < 0:
        raise ValueError(f"topk must be >= 0 (0: no soft labels), got {topk}")
    seqs = [s for s in read_shards(data_dir) if len(s.tokens) - s.prompt_len >= 2]
    if not seqs:
        raise ValueError(f"no training sequences in {data_dir}: `dominotree train data` writes them")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    seqs = [type(s)(s.tokens[:max_len], s.prompt_len, s.source) for s in seqs if s.prompt_len < max_len - 2]
    lens = np.array([len(s.tokens) for s in seqs])
    offsets = np.concatenate([[0], np.cumsum(lens)])
    tokens = np.concatenate([s.tokens for s in seqs]).astype(np.int32)
    dim = len(layer_ids) * target.hidden_size
    total = int(offsets[-1])
    plan = {"layer_ids": list(layer_ids), "dim": dim, "topk": topk, "target": target.name,
            "target_dtype": str(target.dtype), "sequences": len(seqs), "tokens": total,
            "tokens_sha1": hashlib.sha1(tokens.tobytes()).hexdigest()}
    old = _reusable_prefix(out, tokens, offsets, layer_ids, topk, target.name, str(target.dtype))
    finished = _resumable_progress(out, plan, total * dim * 2)
    if old is None:      # the file is about to hold another store's rows: nothing may read it as the old one
        (out / "features.json").unlink(missing_ok=True)
        if finished is None:
            for name in ("topk_ids", "topk_logp"):      # stale soft labels must not outlive the features
                for suffix in ("", ".tmp"):
                    (out / f"{name}{suffix}.npy").unlink(missing_ok=True)
            (out / "features.u16").unlink(missing_ok=True)
    if finished is None:
        finished = np.zeros(len(seqs), dtype=bool)
    if old is not None:
        finished[:len(old)] = True
    with open(out / "features.u16", "ab") as f:     # grow (or create) the file; the kept prefix is untouched
        f.truncate(total * dim * 2)
    feats = np.memmap(out / "features.u16", dtype=np.uint16, mode="r+", shape=(total, dim))
    writer = TopkWriter(out, total, topk) if topk else None
    if writer and old is not None:
        kept = int(offsets[len(old)])
        writer.ids[:kept], writer.logp[:kept] = old.topk_ids, old.topk_logp
    np.save(out / "tokens.npy", tokens)
    (out / "progress.json").write_text(json.dumps(plan))

    def save_progress():
        feats.flush()
        if writer:
            writer.flush()
        np.save(out / "progress.tmp.npy", finished)     # rows first, then the record that they are there
        (out / "progress.tmp.npy").replace(out / "progress.npy")

    base = target.model.base_model
    todo = np.flatnonzero(~finished)
    print(f"target features: {len(seqs) - len(todo)} sequences kept, {len(todo)} to compute")
    t_start = last_save = time.monotonic()
    for part in tqdm(length_batches(lens[todo], batch_tokens), desc="target features"):
        batch = todo[part]
        w = int(max(lens[i] for i in batch))
        ids = torch.zeros(len(batch), w, dtype=torch.long)
        for r, i in enumerate(batch):
            ids[r, :lens[i]] = torch.from_numpy(seqs[i].tokens)
        hs = base(input_ids=ids, output_hidden_states=True).hidden_states   # right padding: causal, harmless
        fts = torch.cat([hs[l + 1] for l in layer_ids], -1).to(torch.bfloat16)
        top = target_topk(target, hs[-1], topk) if topk else None
        for r, i in enumerate(batch):
            feats[offsets[i]:offsets[i + 1]] = fts[r, :lens[i]].view(torch.uint16).numpy()
            if writer:
                writer.write(int(offsets[i]), top, r, int(lens[i]))
        finished[batch] = True
        if time.monotonic() - last_save >= save_every_s:
            save_progress()
            last_save = time.monotonic()
        if time_limit_s is not None and time.monotonic() - t_start >= time_limit_s:
            break
    if not finished.all():
        save_progress()
        print(f"target features: stopped at the time limit with {int(finished.sum())} of {len(seqs)} "
              f"sequences done; run again to continue")
        return None
    feats.flush()
    del feats
    if writer:
        writer.close()
    (out / "features.json").write_text(json.dumps({
        "layer_ids": list(layer_ids), "dim": dim, "offsets": offsets.tolist(),
        "prompt_lens": [s.prompt_len for s in seqs], "target": target.name, "target_dtype": str(target.dtype)}))
    for name in ("progress.json", "progress.npy"):
        (out / name).unlink(missing_ok=True)
    return FeatureStore(out)


def recorded_precision(out: Path) -> str | None:
    """The precision ("bf16" | "fp32") of the pass a store directory holds: its unfinished pass if
    any, else its finished store; None for an empty directory. `--precision auto` keeps it, so a
    resumed or extended pass never restarts because a timing on a busy CPU chose the other one."""
    for name in ("progress.json", "features.json"):
        try:
            dtype = json.loads((Path(out) / name).read_text()).get("target_dtype")
        except (OSError, ValueError, AttributeError):
            continue
        precision = {"torch.bfloat16": "bf16", "torch.float32": "fp32"}.get(dtype)
        if precision:
            return precision
    return None


def _resumable_progress(out: Path, plan: dict, nbytes: int) -> np.ndarray | None:
    """The finished-sequence mask of an unfinished pass over exactly this request, or None."""
    try:
        same = json.loads((out / "progress.json").read_text()) == plan
        finished = np.load(out / "progress.npy") if same else None
    except (OSError, ValueError):
        return None
    if finished is None or finished.shape != (plan["sequences"],) or finished.dtype != bool:
        return None
    if not (out / "features.u16").exists() or (out / "features.u16").stat().st_size != nbytes:
        return None
    if plan["topk"] and not all((out / f"{n}.tmp.npy").exists() for n in ("topk_ids", "topk_logp")):
        return None
    return finished
