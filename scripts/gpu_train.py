"""GPU job: the target writes fresh training data and the drafter pair trains on it, in one sitting.

  python scripts/gpu_train.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --prompts prompts.npz \
      --old-data train_data/smollm2-135m --dflash checkpoints/smollm2-135m-dflash \
      --domino checkpoints/smollm2-135m-domino --out OUT --gen-seconds 150 --deadline-s 420

1. Data: the target (bf16, on the GPU) answers the training prompts with train/batch_decode.py:
   first the prompts the committed shards do not answer (greedy), then every prompt again, sampled
   (--temperature), in batches of --gen-batch rows, until --gen-seconds have passed.
2. Training: train/online.py continues the DFlash backbone and the Domino head together on the
   committed shards plus the new answers, features computed per step, until --deadline-s.
3. Out: OUT/dflash/ (a DFlash checkpoint), OUT/domino/head.safetensors + config.json (the Domino
   head alone: its backbone is the DFlash one; `merge_domino` below puts the pair back together),
   OUT/gen_data_K.npz (as much of the new data as fits the files that come back), OUT/log.jsonl.

--prompts is the training prompt list already chat-templated and tokenized (`--write-prompts` on a
machine with the offline prompt packages writes it), so the GPU machine needs no tokenizer."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch


def write_prompts(path: Path) -> None:
    from dominotree.target import load_target
    from dominotree.train.prompts import training_prompts
    target = load_target("smollm2-135m")
    rows = training_prompts(0)
    enc = [target.encode_prompt(p) for _, p in rows]
    lens = np.array([len(e) for e in enc])
    eos = sorted(target.eos_token_ids)
    pad = target.tokenizer.pad_token_id
    np.savez_compressed(path, tokens=np.concatenate(enc).astype(np.uint16), offsets=np.concatenate([[0], np.cumsum(lens)]),
                        sources=np.array([s for s, _ in rows]), eos=np.array(eos),
                        pad=np.array(pad if pad is not None else eos[0]))


def load_target_model(args, device):
    from transformers import AutoModelForCausalLM
    if args.gguf:
        g = Path(args.gguf)
        model = AutoModelForCausalLM.from_pretrained(g.parent, gguf_file=g.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    return model.to(device=device, dtype=torch.bfloat16).eval()


def prompt_plan(prompts, answered: int, temperature: float, max_prompt: int, seed: int):
    """(prompt index, temperature) in the order they are answered: the unanswered prompts greedy,
    then every prompt sampled, in a fixed shuffled order."""
    off = prompts["offsets"]
    ok = [i for i in range(len(off) - 1) if 0 < off[i + 1] - off[i] <= max_prompt]
    fresh = [(i, 0.0) for i in ok if i >= answered]
    again = [ok[j] for j in np.random.default_rng(seed).permutation(len(ok))]
    return fresh + [(i, temperature) for i in again]


def generate(model, prompts, plan, args, t_end):
    from dominotree.train.batch_decode import BatchDecoder
    dec = BatchDecoder(model)
    tokens, off = prompts["tokens"], prompts["offsets"]
    eos, pad = set(int(e) for e in prompts["eos"]), int(prompts["pad"])
    gen = torch.Generator(device=model.device).manual_seed(args.seed)
    out, done, last = [], 0, 0.0
    while done < len(plan):
        chunk = plan[done:done + args.gen_batch]
        if time.time() + last * 1.1 > t_end:
            break
        t = time.time()
        for temp in sorted({p[1] for p in chunk}):
            rows = sorted((i for i, tt in chunk if tt == temp), key=lambda i: off[i + 1] - off[i])
            ids = [tokens[off[i]:off[i + 1]].astype(np.int64).tolist() for i in rows]
            resp = dec.generate(ids, args.max_new_tokens, eos, temperature=temp, generator=gen, pad_id=pad)
            out += [(np.array(p + r, dtype=np.int64), len(p), i, temp) for p, r, i in zip(ids, resp, rows)]
        done += len(chunk)
        last = time.time() - t
        made = sum(len(s) - p for s, p, _, _ in out)
        print(json.dumps({"generated_prompts": done, "response_tokens": made, "batch_s": round(last, 1)}), flush=True)
    return out


def save_data(seqs, out: Path, files: int, max_bytes: int) -> int:
    """As many sequences as fit `files` compressed npz files of at most max_bytes each; returns how many."""
    start = 0
    for k in range(files):
        if start >= len(seqs):
            break
        n = len(seqs) - start
        while n > 0:
            part = seqs[start:start + n]
            path = out / f"gen_data_{k}.npz"
            np.savez_compressed(path, tokens=np.concatenate([s[0] for s in part]).astype(np.uint16),
                                offsets=np.concatenate([[0], np.cumsum([len(s[0]) for s in part])]),
                                prompt_lens=np.array([s[1] for s in part]), prompt_index=np.array([s[2] for s in part]),
                                temperature=np.array([s[3] for s in part], dtype=np.float32))
            size = path.stat().st_size
            if size <= max_bytes:
                break
            n = int(n * max_bytes / size * 0.97)
        start += n
    return start


def save_split(drafter, out: Path) -> None:
    """OUT/dflash (backbone) and OUT/domino (head tensors + config): each file small enough to come back."""
    from safetensors.torch import load_file, save_file
    from dominotree.train.online import save_drafters
    tmp = out / "_domino_full"
    save_drafters(drafter, out / "dflash", tmp)
    state = load_file(str(tmp / "model.safetensors"))
    (out / "domino").mkdir(exist_ok=True)
    save_file({k: v for k, v in state.items() if k.startswith(("embed_proj", "prefix_gru"))},
              str(out / "domino" / "head.safetensors"), metadata={"format": "pt"})
    (out / "domino" / "config.json").write_text((tmp / "config.json").read_text())
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()


def merge_domino(dflash_dir: Path, head_dir: Path, out: Path) -> None:
    """A Domino checkpoint from save_split's two halves."""
    from safetensors.torch import load_file, save_file
    out.mkdir(parents=True, exist_ok=True)
    state = load_file(str(Path(dflash_dir) / "model.safetensors"))
    state.update(load_file(str(Path(head_dir) / "head.safetensors")))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text((Path(head_dir) / "config.json").read_text())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write-prompts", type=Path, help="write the tokenized prompt list here and stop")
    ap.add_argument("--gguf")
    ap.add_argument("--target", help="a local HF model directory instead of --gguf")
    ap.add_argument("--prompts", type=Path)
    ap.add_argument("--answered", type=int, default=31744, help="prompts the committed shards answer")
    ap.add_argument("--old-data", type=Path)
    ap.add_argument("--dflash", type=Path)
    ap.add_argument("--domino", type=Path)
    ap.add_argument("--domino-head", type=Path, help="instead of --domino: a head as save_split writes it "
                    "(its backbone is --dflash's)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gen-seconds", type=float, default=150)
    ap.add_argument("--gen-batch", type=int, default=2048)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--deadline-s", type=float, default=420, help="training ends this long after the start")
    ap.add_argument("--save-reserve-s", type=float, default=25)
    ap.add_argument("--seqs-per-step", type=int, default=16)
    ap.add_argument("--anchors-per-seq", type=int, default=48)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--head-lr", type=float, default=8e-4)
    ap.add_argument("--data-files", type=int, default=2)
    ap.add_argument("--data-file-bytes", type=int, default=15 * 2 ** 20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.write_prompts:
        write_prompts(args.write_prompts)
        return
    t0 = time.time()
    from dominotree.train.data import read_shards
    from dominotree.train.online import OnlineConfig, OnlineTrainer, load_domino
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    model = load_target_model(args, device)
    print(json.dumps({"target_loaded_s": round(time.time() - t0, 1)}), flush=True)
    new = []
    if args.prompts and args.gen_seconds > 0:
        try:
            prompts = dict(np.load(args.prompts))
            plan = prompt_plan(prompts, args.answered, args.temperature, args.max_prompt, args.seed)
            new = generate(model, prompts, plan, args, time.time() + args.gen_seconds)
        except Exception as e:          # training on the committed data alone is still worth the sitting
            print(json.dumps({"generation_failed": repr(e)}), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()     # the decoder's KV buffers go back before training allocates
    kept = save_data(new, args.out, args.data_files, args.data_file_bytes) if new else 0
    old = [(s.tokens, s.prompt_len) for s in read_shards(args.old_data)] if args.old_data else []
    seqs = [(t, p) for t, p in old + [(s[0], s[1]) for s in new] if len(t) - p >= 2 and p < 766]
    print(json.dumps({"old_sequences": len(old), "new_sequences": len(new), "new_saved": kept,
                      "new_response_tokens": int(sum(len(s[0]) - s[1] for s in new)),
                      "train_sequences": len(seqs), "elapsed_s": round(time.time() - t0, 1)}), flush=True)
    seconds = args.deadline_s - args.save_reserve_s - (time.time() - t0)
    oc = OnlineConfig(out=str(args.out), seconds=seconds, seqs_per_step=args.seqs_per_step,
                      anchors_per_seq=args.anchors_per_seq, lr=args.lr, head_lr=args.head_lr, seed=args.seed)
    domino = args.domino
    if args.domino_head:
        domino = args.out / "_domino_init"
        merge_domino(args.dflash, args.domino_head, domino)
    trainer = OnlineTrainer(model, load_domino(args.dflash, domino), oc)
    if args.domino_head:
        for f in domino.iterdir():
            f.unlink()
        domino.rmdir()
    trainer.run(seqs)
    save_split(trainer.drafter, args.out)
    print(json.dumps({"saved": True, "elapsed_s": round(time.time() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
