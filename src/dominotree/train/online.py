"""Drafter training with the target's features computed at every step (for a GPU).

On the CPU the recipe caches the target's features once (train/features.py) because a target pass
costs more than a training step; on a GPU the pass is cheap and a store of tens of millions of
tokens is not, so each step runs the target over its sequences and builds the blocks on the device
(train/blocks.py sample_anchors / blocks_from_anchors). One run trains the DFlash backbone and the
Domino head together: the head sees the backbone's output detached, so the backbone learns only
from its own loss (what a marginal tree needs) and the head the path correction on top of it,
as the recipe's head on a fixed backbone does. The schedule runs over wall-clock time, not steps."""
from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..drafters import build_drafter, load_checkpoint, save_checkpoint
from .blocks import blocks_from_anchors, depth_weights, sample_anchors
from .dflash import accept_len, block_hidden, weighted_ce
from .domino import teacher_forced_logits


@dataclass
class OnlineConfig:
    out: str
    seconds: float                 # wall-clock budget; the learning rate's schedule runs over it
    seqs_per_step: int = 16
    anchors_per_seq: int = 48
    lr: float = 3e-4               # backbone (continuing a trained one)
    head_lr: float = 5e-4
    gamma: float = 2.0             # backbone loss decay over depth (the recipe's continuations)
    head_gamma: float = 7.0        # head loss decay (the recipe's head runs)
    warmup_frac: float = 0.03
    min_lr_frac: float = 0.1
    weight_decay: float = 0.01
    clip: float = 1.0
    max_len: int = 768
    heldout: int = 256             # sequences kept out of training, scored every eval_every steps
    eval_every: int = 100
    log_every: int = 20
    seed: int = 0


def lr_scale(frac: float, oc: OnlineConfig) -> float:
    if frac < oc.warmup_frac:
        return max(frac, 1e-3) / oc.warmup_frac
    p = min(1.0, (frac - oc.warmup_frac) / max(1e-9, 1 - oc.warmup_frac))
    return oc.min_lr_frac + (1 - oc.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p))


def pad_batch(seqs, idx, max_len: int, device):
    """Right-padded tokens [B, S], lengths and prompt lengths of sequences idx."""
    rows = [seqs[i] for i in idx]
    lens = [min(len(t), max_len) for t, _ in rows]
    tokens = torch.zeros(len(rows), max(lens), dtype=torch.long)
    for r, (t, _) in enumerate(rows):
        tokens[r, :lens[r]] = torch.from_numpy(np.asarray(t[:lens[r]], dtype=np.int64))
    return (tokens.to(device), torch.tensor(lens, device=device),
            torch.tensor([p for _, p in rows], device=device))


class OnlineTrainer:
    def __init__(self, model, drafter, oc: OnlineConfig):
        """model: the HF target on its device; drafter: a Domino drafter (backbone + head)."""
        self.model, self.oc = model, oc
        self.dev = model.get_input_embeddings().weight.device
        self.drafter, self.cfg = drafter, drafter.config
        for m in (drafter.backbone, drafter.head):
            m.float().to(self.dev).train()
        self.embed_w = model.get_input_embeddings().weight.detach()
        self.head_w = model.get_output_embeddings().weight.detach()
        D = self.cfg.num_depths
        self.w_base = depth_weights(D, oc.gamma).to(self.dev)
        self.w_final = depth_weights(D, oc.head_gamma).to(self.dev)
        groups = []
        for module, lr in ((drafter.backbone, oc.lr), (drafter.head, oc.head_lr)):
            ps = list(module.parameters())
            groups += [{"params": [p for p in ps if p.dim() > 1], "weight_decay": oc.weight_decay, "base_lr": lr},
                       {"params": [p for p in ps if p.dim() <= 1], "weight_decay": 0.0, "base_lr": lr}]
        self.opt = torch.optim.AdamW(groups, lr=oc.lr, betas=(0.9, 0.95))
        self.gen = torch.Generator(device=self.dev).manual_seed(oc.seed)

    @torch.no_grad()
    def features(self, tokens):
        """The tapped layers' outputs (HF hidden_states[l + 1]) for right-padded tokens."""
        hs = self.model.model(input_ids=tokens, output_hidden_states=True).hidden_states
        return torch.cat([hs[l + 1] for l in self.cfg.target_layer_ids], -1).to(torch.bfloat16)

    def losses(self, seqs, idx):
        tokens, lens, plens = pad_batch(seqs, idx, self.oc.max_len, self.dev)
        anchors, valid = sample_anchors(lens, plens, self.oc.anchors_per_seq, self.gen)
        batch = blocks_from_anchors(tokens, lens, self.features(tokens), anchors, valid, self.cfg.block_size,
                                    self.cfg.num_depths, self.cfg.mask_token_id)
        with torch.autocast(self.dev.type, dtype=torch.bfloat16):
            hid = block_hidden(self.drafter.backbone, batch, self.embed_w, self.cfg)      # [B, N, D, h]
            base = F.linear(hid, self.head_w)
            loss_base, hits_base = weighted_ce(base, batch.labels, self.w_base)
            final = teacher_forced_logits(self.drafter.head, hid.detach(), base.detach(), batch.truth,
                                          self.embed_w, self.cfg.pure_draft_prefix_len)
            loss_final, hits_final = weighted_ce(final, batch.labels, self.w_final)
        return loss_base, loss_final, accept_len(hits_base), accept_len(hits_final)

    def run(self, seqs) -> list[dict]:
        """Train until oc.seconds have passed; returns the log (also written to out/log.jsonl)."""
        oc = self.oc
        out = Path(oc.out)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "log.jsonl", "a") as f:          # the run's settings head its log
            f.write(json.dumps({"config": asdict(oc), "sequences": len(seqs)}) + "\n")
        g = torch.Generator().manual_seed(oc.seed)
        order = torch.randperm(len(seqs), generator=g).tolist()
        held, train = order[:oc.heldout], order[oc.heldout:]
        if not train:
            raise ValueError(f"{len(seqs)} sequences leave none for training after {oc.heldout} held out")
        log, step, t0 = [], 0, time.time()
        params = {"backbone": list(self.drafter.backbone.parameters()), "head": list(self.drafter.head.parameters())}
        while True:
            frac = (time.time() - t0) / oc.seconds
            if frac >= 1:
                break
            for grp in self.opt.param_groups:
                grp["lr"] = grp["base_lr"] * lr_scale(frac, oc)
            idx = [train[int(i)] for i in torch.randint(len(train), (oc.seqs_per_step,), generator=g)]
            loss_base, loss_final, al_b, al_f = self.losses(seqs, idx)
            self.opt.zero_grad(set_to_none=True)
            (loss_base + loss_final).backward()
            norms = {k: float(torch.nn.utils.clip_grad_norm_(v, oc.clip)) for k, v in params.items()}
            self.opt.step()
            step += 1
            if step % oc.log_every == 0:
                rec = {"step": step, "elapsed_s": round(time.time() - t0, 1), "lr_scale": lr_scale(frac, oc),
                       "loss_base": float(loss_base.detach()), "loss_final": float(loss_final.detach()),
                       "accept_len_base": al_b, "accept_len_final": al_f,
                       "grad_norm_backbone": norms["backbone"], "grad_norm_head": norms["head"]}
                if held and step % oc.eval_every == 0:
                    rec.update(self.evaluate(seqs, held))
                log.append(rec)
                with open(out / "log.jsonl", "a") as f:
                    f.write(json.dumps(rec) + "\n")
                print(json.dumps(rec), flush=True)
        if held:
            rec = {"step": step, "elapsed_s": round(time.time() - t0, 1), "final": True, **self.evaluate(seqs, held)}
            log.append(rec)
            with open(out / "log.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
            print(json.dumps(rec), flush=True)
        for m in (self.drafter.backbone, self.drafter.head):
            m.eval()
        return log

    @torch.no_grad()
    def evaluate(self, seqs, held) -> dict:
        """Teacher-forced chain accept lengths on the held-out sequences (fixed anchors per call)."""
        state = self.gen.get_state()
        self.gen.manual_seed(12345)
        res = []
        for i in range(0, len(held), self.oc.seqs_per_step):
            res.append(self.losses(seqs, held[i:i + self.oc.seqs_per_step]))
        self.gen.set_state(state)
        mean = lambda k: float(np.mean([float(r[k]) for r in res]))
        return {"held_loss_base": mean(0), "held_loss_final": mean(1),
                "held_accept_len_base": mean(2), "held_accept_len_final": mean(3)}


def load_domino(dflash_dir: Path, domino_dir: Path | None):
    """A Domino drafter to train: the DFlash checkpoint's backbone, the Domino checkpoint's head."""
    if domino_dir is None:
        raise ValueError("online training continues a Domino checkpoint's head: give its directory")
    drafter = load_checkpoint(Path(domino_dir), dtype=torch.float32, pack=False)
    backbone = load_checkpoint(Path(dflash_dir), dtype=torch.float32, pack=False).backbone
    drafter.backbone.load_state_dict(backbone.state_dict())
    return drafter


def save_drafters(drafter, dflash_dir: Path, domino_dir: Path) -> None:
    """The trained pair as checkpoints: the backbone alone (DFlash) and backbone + head (Domino)."""
    dflash = build_drafter(dataclasses.replace(drafter.config, projector_type=None), Path(dflash_dir).name)
    dflash.backbone.load_state_dict(drafter.backbone.state_dict())
    save_checkpoint(dflash, Path(dflash_dir))
    save_checkpoint(drafter, Path(domino_dir))
