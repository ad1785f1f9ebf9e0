"""`dominotree train dflash|domino`: train a block drafter (and optionally the Domino head) on
cached target features. One loop for both; the Domino-specific loss lives in train/domino.py."""
from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..drafters import DFlashBackbone, DrafterConfig, build_drafter, save_checkpoint
from .blocks import depth_weights, make_batch
from .features import FeatureStore
from .run_config import TrainConfig, check_same_run, drafter_config, lr_at


def train(target, store: FeatureStore, tc: TrainConfig, progress: bool = True):
    """Run (or continue, from tc.out's saved state) a training run; the trained drafter, or None
    when tc.time_limit_s stopped it first."""
    from .domino import domino_loss
    out = Path(tc.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(tc.seed)
    layer_ids, feat_cols = tap_columns(store, tc.layer_ids)
    cfg = drafter_config(tc, target, layer_ids)
    drafter = build_drafter(cfg, out.name)
    if tc.init_layers == "target":
        from .target_init import init_from_target_layers
        init_from_target_layers(drafter.backbone, target)
    head_loaded = init_weights(drafter, tc)
    modules = ([] if tc.freeze_backbone else [drafter.backbone]) + ([drafter.head] if tc.head else [])
    drafter.backbone.float().requires_grad_(not tc.freeze_backbone)
    for m in modules:
        m.float().train()
    params = [p for m in modules for p in m.parameters()]
    decay = [p for p in params if p.dim() > 1]
    no_decay = [p for p in params if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=tc.lr, betas=(0.9, 0.95))
    low = torch.bfloat16 if tc.precision == "bf16" else torch.float32
    embed_w = target.model.get_input_embeddings().weight.detach().to(low)
    head_w = target.model.get_output_embeddings().weight.detach().to(low)
    seen, remap = training_vocab(store, cfg.vocab_size, tc.vocab, tc.vocab_min_count, tc.vocab_top)
    unseen = (remap < 0).nonzero()[:, 0]
    if tc.head and not head_loaded:
        with torch.no_grad():   # unseen tokens' correction starts at 0, not at random (negatives only push it down)
            drafter.head.embed_proj[2].weight[unseen] = 0
    weights = depth_weights(cfg.num_depths, tc.gamma)
    state_file, log_file = out / "train_state.pt", out / "log.jsonl"
    step = 0
    gen = torch.Generator().manual_seed(tc.seed)
    if state_file.exists():
        check_same_run(out, tc)
        st = torch.load(state_file, weights_only=False)
        drafter.backbone.load_state_dict(st["backbone"])
        if tc.head:
            drafter.head.load_state_dict(st["head"])
        opt.load_state_dict(st["opt"])
        step = st["step"]
        gen.set_state(st["gen"])
        if log_file.exists():   # rows logged after the last save are redone: keep one copy
            rows = [l for l in log_file.read_text().splitlines() if json.loads(l)["step"] <= step]
            log_file.write_text("".join(r + "\n" for r in rows))
    (out / "train_config.json").write_text(json.dumps(asdict(tc), indent=2))
    bar = tqdm(total=tc.steps, initial=step, desc=f"train {out.name}", disable=not progress)
    t0 = time.time()
    while step < tc.steps:
        idx = torch.randint(len(store), (tc.seqs_per_step,), generator=gen).tolist()
        batch = make_batch([store.sequence(i, feat_cols) for i in idx], cfg.block_size, tc.anchors_per_seq,
                           cfg.num_depths, cfg.mask_token_id, gen,
                           topk=[store.topk(i) for i in idx] if tc.distill > 0 else None)
        batch.ctx_feats = batch.ctx_feats.to(low)
        batch.labels = label_columns(batch.labels, remap)
        if batch.soft_ids is not None:     # soft labels outside the training vocabulary are dropped
            batch.soft_ids = torch.where(batch.soft_ids >= 0, remap[batch.soft_ids.clamp_min(0)], batch.soft_ids)
        neg = unseen[torch.randperm(len(unseen), generator=gen)[:tc.negatives]]
        vocab_ids = torch.cat([seen, neg])                        # labels index the `seen` part
        # a frozen backbone gets no gradient from the base term: the head's loss is all there is
        lam = max(0.0, 1.0 - step / max(1, tc.steps - 1)) if tc.curriculum and not tc.freeze_backbone else 0.0
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tc)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=tc.precision == "bf16"):
            with torch.set_grad_enabled(not tc.freeze_backbone):
                hid = block_hidden(drafter.backbone, batch, embed_w, cfg)
            loss, metrics = domino_loss(drafter, hid, batch, embed_w, head_w[vocab_ids], vocab_ids, weights, cfg, lam, tc)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, tc.clip)
        opt.step()
        step += 1
        bar.update()
        if step % tc.log_every == 0 or step == tc.steps:
            rec = {"step": step, "loss": float(loss.detach()), "lr": lr_at(step - 1, tc), "lambda": lam,
                   "grad_norm": float(gnorm), "elapsed_s": time.time() - t0, **metrics}
            with open(log_file, "a") as f:
                f.write(json.dumps(rec) + "\n")
            bar.set_postfix(loss=f"{rec['loss']:.3f}", acc_len=f"{metrics.get('accept_len_final', metrics['accept_len_base']):.2f}")
        out_of_time = tc.time_limit_s is not None and time.time() - t0 >= tc.time_limit_s
        if step % tc.save_every == 0 or step == tc.steps or out_of_time:
            st = {"backbone": drafter.backbone.state_dict(), "opt": opt.state_dict(), "step": step,
                  "gen": gen.get_state()}
            if tc.head:
                st["head"] = drafter.head.state_dict()
            torch.save(st, state_file.with_suffix(".tmp"))
            state_file.with_suffix(".tmp").rename(state_file)
        if out_of_time:
            break
    bar.close()
    if step < tc.steps:
        print(f"train {out.name}: stopped at the time limit after step {step} of {tc.steps}; "
              "run the same command again to continue")
        return None
    for m in modules:
        m.eval()
    save_checkpoint(drafter, out / "model")
    plot_log(log_file, out / "loss.png")
    return drafter


def tap_columns(store: FeatureStore, layer_ids) -> tuple[list[int], np.ndarray | None]:
    """The taps a run uses and the feature columns that hold them (None: all of the store's)."""
    if layer_ids is None or list(layer_ids) == list(store.layer_ids):
        return list(store.layer_ids), None
    missing = [i for i in layer_ids if i not in store.layer_ids]
    if missing:
        raise ValueError(f"target layers {missing} are not in the feature store (it has {store.layer_ids}); "
                         f"run `dominotree train features --layers ...` with them")
    h = store.dim // len(store.layer_ids)
    cols = np.concatenate([store.layer_ids.index(i) * h + np.arange(h) for i in layer_ids])
    return list(layer_ids), cols


def init_weights(drafter, tc: TrainConfig) -> bool:
    """Start from trained checkpoints: init_from's backbone (and, for a Domino run, its head), or
    head_from's head. Returns whether the head was loaded. A backbone with fewer layers or taps
    than this run's is grown into it (train/grow.py: the new parts start as no-ops)."""
    from ..drafters import load_checkpoint
    from .grow import grow_backbone
    loaded = False
    if tc.init_from:
        init = load_checkpoint(Path(tc.init_from))
        added = grow_backbone(drafter.backbone, init.backbone.float())
        if any(added.values()):
            print(f"grown from {tc.init_from}: " + ", ".join(f"{k} {v}" for k, v in added.items() if v))
        if tc.head and not tc.head_from and getattr(init, "head", None) is not None:
            load_head(drafter, init, tc.init_from, tc)   # a Domino checkpoint: continue its head too
            loaded = True
    if tc.head_from:
        src = load_checkpoint(Path(tc.head_from))
        if not tc.head or getattr(src, "head", None) is None:
            raise ValueError(f"head_from needs a Domino run and a Domino checkpoint; {tc.head_from} "
                             f"{'has no head' if tc.head else 'was given to a run without a head'}")
        load_head(drafter, src, tc.head_from, tc)
        loaded = True
    return loaded


def load_head(drafter, src, src_path, tc: TrainConfig) -> None:
    try:
        drafter.head.load_state_dict({k: v.float() for k, v in src.head.state_dict().items()})
    except RuntimeError as e:
        raise ValueError(f"the head of {src_path} does not fit this run's head "
                         f"(emb_dim {tc.emb_dim}, gru_hidden_dim {tc.gru_hidden_dim}): {e}") from None


def training_vocab(store: FeatureStore, vocab_size: int, mode: str,
                   min_count: int = 1, top: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids the loss's softmax runs over, and the map token id -> column (-1: not in it).
    "data": the tokens occurring in the store at least min_count times (the softmax's width is
    most of a step's cost, and the long tail of once-seen tokens makes it wide on large data);
    with `top`, only the `top` tokens its responses hold most often (ties: the smaller id), as
    draft_vocab.py ranks them for `draft_vocab=top`."""
    if mode == "full":
        if top:
            raise ValueError("vocab_top caps the 'data' vocabulary; --vocab full has no cap")
        ids = torch.arange(vocab_size)
    elif mode == "data":
        if min_count < 1:
            raise ValueError(f"vocab_min_count must be >= 1, got {min_count}")
        if top < 0:
            raise ValueError(f"vocab_top must be >= 0 (0: no cap), got {top}")
        toks, counts = np.unique(np.asarray(store.tokens), return_counts=True)
        keep = toks[counts >= min_count]
        if top:
            ranked = response_ranking(store, vocab_size)[:top]
            keep = np.intersect1d(keep, ranked)
        ids = torch.from_numpy(keep).long()
        if len(ids) == 0:
            raise ValueError(f"no token occurs {min_count} times in the data: lower vocab_min_count")
    else:
        raise ValueError(f"vocab must be 'data' or 'full', got {mode!r}")
    remap = torch.full((vocab_size,), -1, dtype=torch.long)
    remap[ids] = torch.arange(len(ids))
    return ids, remap


def response_ranking(store: FeatureStore, vocab_size: int) -> np.ndarray:
    """Token ids by how often the store's responses (not its prompts) hold them; ties: the smaller id."""
    lens = np.diff(store.offsets)
    position = np.arange(int(store.offsets[-1])) - np.repeat(store.offsets[:-1], lens)   # within its sequence
    in_response = position >= np.repeat(store.prompt_lens, lens)
    from ..draft_vocab import rank_by_count
    return rank_by_count(np.asarray(store.tokens)[in_response], vocab_size)


def label_columns(labels: torch.Tensor, remap: torch.Tensor) -> torch.Tensor:
    """Token-id labels as columns of the training vocabulary; -100 (ignored) stays, and so becomes
    a label outside the vocabulary (a token rarer than vocab_min_count)."""
    cols = remap[labels.clamp_min(0)]
    return torch.where((labels >= 0) & (cols >= 0), cols, torch.full_like(labels, -100))


def block_hidden(backbone: DFlashBackbone, batch, embed_w, cfg: DrafterConfig) -> torch.Tensor:
    """Backbone output per depth: [B, N, D, h]."""
    ctx = backbone.project_context(batch.ctx_feats)
    ctx_kv = backbone.context_kv(ctx, batch.ctx_pos)
    B, N = batch.labels.shape[:2]
    anchor_ctx = None
    if cfg.anchor_fusion:    # the context row just before each root (unused slots: row 0, no labels)
        before = (batch.block_pos[:, ::cfg.block_size] - 1).clamp_min(0)            # [B, N]
        anchor_ctx = ctx.gather(1, before[..., None].expand(-1, -1, ctx.shape[-1]))
        anchor_ctx = anchor_ctx.repeat_interleave(cfg.block_size, 1)
    hid = backbone(embed_w[batch.block_ids], batch.block_pos, ctx_kv, batch.mask, anchor_ctx)
    hid = hid.view(B, N, cfg.block_size, -1)
    return hid[:, :, :cfg.num_depths] if cfg.shift_label else hid[:, :, 1:]


def weighted_ce(logits, labels, weights, logq=None):
    """Per-depth-weighted cross-entropy (from logq = log_softmax(logits) when the caller has it);
    also the argmax hits per position."""
    V = logits.shape[-1]
    if logq is None:
        ce = F.cross_entropy(logits.float().reshape(-1, V), labels.reshape(-1), ignore_index=-100, reduction="none")
    else:
        ce = F.nll_loss(logq.reshape(-1, V), labels.reshape(-1), ignore_index=-100, reduction="none")
    ce = ce.view(labels.shape)
    valid = (labels != -100).float()
    w = weights.view(1, 1, -1) * valid
    hits = (logits.argmax(-1) == labels) & (labels != -100)
    return (ce * w).sum() / w.sum().clamp_min(1e-6), hits


def soft_ce(logq, soft_ids, soft_logp, labels, weights):
    """Per-depth-weighted cross-entropy of log-probs logq against the target's top-k, renormalised
    over the ids kept (-1 = dropped)."""
    p = torch.where(soft_ids >= 0, soft_logp.float().exp(), torch.zeros(()))
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
    ce = -(p * logq.gather(-1, soft_ids.clamp_min(0))).sum(-1)
    w = weights.view(1, 1, -1) * (labels != -100).float()
    return (ce * w).sum() / w.sum().clamp_min(1e-6)


def accept_len(hits: torch.Tensor) -> float:
    """Mean accepted length (bonus included) if each block were verified as a chain."""
    return float(hits.long().cumprod(-1).sum(-1).float().mean() + 1)


def plot_log(log_file: Path, png: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [json.loads(l) for l in open(log_file)] if log_file.exists() else []
    if not rows:
        return
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    steps = [r["step"] for r in rows]
    ax[0].plot(steps, [r["loss"] for r in rows])
    ax[0].set_xlabel("step"); ax[0].set_ylabel("loss"); ax[0].set_title(png.parent.name)
    for key in ("accept_len_base", "accept_len_final"):
        if key in rows[0]:
            ax[1].plot(steps, [r[key] for r in rows], label=key)
    ax[1].set_xlabel("step"); ax[1].set_ylabel("chain accept length (train batch)"); ax[1].legend()
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)
