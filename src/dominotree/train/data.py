"""`dominotree train data`: the target writes the drafter's training data.

Prompts (train/prompts.py) are chat-templated; responses are generated in bf16 batches, greedy for
most shards and sampled (T = 0.7) for every `sampled_every`-th shard. Shards are written as
compressed uint16 arrays; an existing shard is skipped, so an interrupted run resumes.

Writing a shard takes this CPU minutes (~6 for 256 prompts), so shards already written by an
earlier run can be committed and reused: `seed_dir` (the repository's `train_data/<model>/`,
`seed_dir_for`) is searched for each missing shard, which is copied when it was made with the same
recipe (same meta apart from the number of prompts) and holds the prompts this shard would get."""
from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..config import check_int
from ..verify import draw_rows, process_logits
from .prompts import training_prompts


@dataclass
class Sequence:
    tokens: np.ndarray   # prompt + response token ids
    prompt_len: int
    source: str


def shard_path(out: Path, k: int) -> Path:
    return out / f"shard_{k:05d}.npz"


def seed_dir_for(model: str) -> Path:
    """Where a source checkout keeps committed training shards for a model (may not exist)."""
    return Path(__file__).resolve().parents[3] / "train_data" / Path(model).name


def write_shard(path: Path, seqs: list[Sequence]) -> None:
    lens = np.array([len(s.tokens) for s in seqs], dtype=np.int64)
    tokens = np.concatenate([s.tokens for s in seqs])
    tmp = path.with_suffix(".tmp.npz")
    np.savez_compressed(tmp, tokens=tokens.astype(np.uint16 if tokens.max(initial=0) < 2 ** 16 else np.uint32),
             offsets=np.concatenate([[0], np.cumsum(lens)]),
             prompt_lens=np.array([s.prompt_len for s in seqs], dtype=np.int64),
             sources=np.array([s.source for s in seqs]))
    tmp.rename(path)


def shard_paths(data_dir: Path) -> list[Path]:
    """The finished shards of a directory, in order (a shard being written is a .tmp.npz)."""
    return sorted(p for p in Path(data_dir).glob("shard_*.npz") if not p.name.endswith(".tmp.npz"))


def read_shards(data_dir: Path) -> list[Sequence]:
    return [s for path in shard_paths(data_dir) for s in read_shard(path)]


def read_shard(path: Path) -> list[Sequence]:
    with np.load(path) as z:
        off = z["offsets"]
        return [Sequence(z["tokens"][off[i]:off[i + 1]].astype(np.int64), int(z["prompt_lens"][i]), str(z["sources"][i]))
                for i in range(len(off) - 1)]


def generate_data(target, out: Path, num_prompts: int = 6000, shard_size: int = 256, batch_size: int = 64,
                  max_new_tokens: int = 256, sampled_every: int = 4, temperature: float = 0.7,
                  seed: int = 0, time_limit_s: float | None = None, seed_dir: Path | None = None) -> dict:
    check_data_request(num_prompts, shard_size, batch_size, max_new_tokens, sampled_every, temperature)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = training_prompts(seed, num_prompts)
    tok = target.tokenizer
    tok.padding_side = "left"
    pad = tok.pad_token_id if tok.pad_token_id is not None else sorted(target.eos_token_ids)[0]
    n_shards = (len(prompts) + shard_size - 1) // shard_size
    meta = {"num_prompts": len(prompts), "shard_size": shard_size, "max_new_tokens": max_new_tokens,
            "sampled_every": sampled_every, "temperature": temperature, "seed": seed, "target": target.name}
    _check_same_recipe(out, meta)
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    seeds = _matching_seed_dir(seed_dir, meta)
    t0, made = time.time(), 0
    bar = tqdm(range(n_shards), desc="train data (shards)")
    for k in bar:
        path = shard_path(out, k)
        rows = prompts[k * shard_size:(k + 1) * shard_size]
        if _shard_rows(path) >= len(rows):
            continue            # written already; a last shard cut short by a smaller num_prompts is redone
        if seeds is not None and _seed_shard_fits(shard_path(seeds, k), len(rows)):
            shutil.copyfile(shard_path(seeds, k), path)      # a copy costs nothing: past the time limit too
            continue
        if time_limit_s is not None and time.time() - t0 > time_limit_s:
            break
        sampled = sampled_every > 0 and k % sampled_every == sampled_every - 1
        gen = torch.Generator().manual_seed(seed * 100003 + k)
        seqs = []
        encoded = sorted(((target.encode_prompt(p), src) for src, p in rows), key=lambda x: len(x[0]))
        for b in range(0, len(encoded), batch_size):
            batch = encoded[b:b + batch_size]
            seqs += _generate_batch(target, batch, pad, max_new_tokens, sampled, temperature, gen)
        write_shard(path, seqs)
        made += sum(len(s.tokens) - s.prompt_len for s in seqs)
        bar.set_postfix(resp_tokens=made, tok_s=f"{made / (time.time() - t0):.0f}")
    return meta


def check_data_request(num_prompts: int, shard_size: int = 256, batch_size: int = 64, max_new_tokens: int = 256,
                       sampled_every: int = 4, temperature: float = 0.7) -> None:
    """A ValueError for a request generate_data cannot honour (before any model loads)."""
    for name, value, low in (("num_prompts", num_prompts, 1), ("shard_size", shard_size, 1),
                             ("batch_size", batch_size, 1), ("max_new_tokens", max_new_tokens, 1),
                             ("sampled_every", sampled_every, 0)):
        check_int(name, value, low)
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature (of the sampled responses) must be a finite number > 0, got {temperature!r}")


def _check_same_recipe(out: Path, meta: dict) -> None:
    """Shards already in `out` are resumed as this run's: refuse them when another target or recipe
    wrote them (mixed shards, and a meta.json rewritten to claim them, would pass for one dataset)."""
    if not (out / "meta.json").is_file():
        return
    held = json.loads((out / "meta.json").read_text())
    differ = [k for k in meta if k != "num_prompts" and k in held and held[k] != meta[k]]
    if differ:
        raise ValueError(f"{out} holds data written with {', '.join(f'{k}={held[k]!r}' for k in differ)}, not "
                         f"{', '.join(f'{k}={meta[k]!r}' for k in differ)}; use another workdir to write it anew")


def _matching_seed_dir(seed_dir: Path | None, meta: dict) -> Path | None:
    """seed_dir if its shards were made with this recipe (meta equal but for num_prompts), else None."""
    if seed_dir is None or not (Path(seed_dir) / "meta.json").is_file():
        return None
    theirs = json.loads((Path(seed_dir) / "meta.json").read_text())
    same = {k: v for k, v in theirs.items() if k != "num_prompts"} == {k: v for k, v in meta.items() if k != "num_prompts"}
    return Path(seed_dir) if same else None


def _shard_rows(path: Path) -> int:
    """Prompts a shard holds (0 if it does not exist)."""
    if not path.is_file():
        return 0
    with np.load(path) as z:
        return len(z["prompt_lens"])


def _seed_shard_fits(path: Path, rows: int) -> bool:
    return _shard_rows(path) == rows     # a shard cut short by a smaller num_prompts is not reused


@torch.inference_mode()
def _generate_batch(target, batch, pad, max_new_tokens, sampled, temperature, gen) -> list[Sequence]:
    """Left-padded batched decoding that drops finished rows from the cache as it goes
    (the long tail of one long answer no longer costs a full batch per step)."""
    from transformers import DynamicCache
    model, eos = target.model, target.eos_token_ids
    width = max(len(ids) for ids, _ in batch)
    n = len(batch)
    input_ids = torch.full((n, width), pad, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    for i, (ids, _) in enumerate(batch):
        input_ids[i, width - len(ids):] = torch.tensor(ids)
        attn[i, width - len(ids):] = 1
    pos = (attn.cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache(config=model.config)
    kw = {target._cache_kw: cache}
    logits = model(input_ids=input_ids, attention_mask=attn, position_ids=pos, use_cache=True,
                   logits_to_keep=1, **kw).logits[:, -1]
    active = list(range(n))                 # batch rows still generating, in cache order
    out: list[list[int]] = [[] for _ in range(n)]
    next_pos = pos[:, -1] + 1
    for step in range(max_new_tokens):
        if sampled:
            nxt = draw_rows(process_logits(logits, temperature), gen)   # ~3x faster than torch.multinomial
        else:
            nxt = logits.argmax(-1)
        keep = []
        for j, row in enumerate(active):
            t = int(nxt[j])
            out[row].append(t)
            if t not in eos and step + 1 < max_new_tokens:
                keep.append(j)
        if not keep:
            break
        if len(keep) < len(active):
            idx = torch.tensor(keep)
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys[idx], layer.values[idx]
            attn, next_pos, nxt = attn[idx], next_pos[idx], nxt[idx]
            active = [active[j] for j in keep]
        attn = torch.cat([attn, torch.ones(len(active), 1, dtype=torch.long)], 1)
        logits = model(input_ids=nxt[:, None], attention_mask=attn, position_ids=next_pos[:, None],
                       use_cache=True, **kw).logits[:, -1]
        next_pos = next_pos + 1
    return [Sequence(np.array(ids + out[i], dtype=np.int64), len(ids), src + ("/sampled" if sampled else ""))
            for i, (ids, src) in enumerate(batch)]
