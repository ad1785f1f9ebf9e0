"""`dominotree train dflash|domino`: train a block drafter (and optionally the Domino head) on
cached target features. One loop for both; the Domino-specific loss lives in train/domino.py."""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..drafters import DFlashBackbone, DrafterConfig, build_drafter, save_checkpoint
from .blocks import depth_weights, make_batch
from .features import FeatureStore


@dataclass
class TrainConfig:
    """One training run. The defaults are the trainer's generic ones, not the recipe's: the CLI
    (`train/pipeline.py`, RECIPE) passes shift_label=True, anchors_per_seq=12 and a precision chosen
    for the CPU, so a Python caller who wants the bundled drafters' setting passes those too."""
    out: str
    steps: int = 1000
    seqs_per_step: int = 8
    anchors_per_seq: int = 16
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_frac: float = 0.04
    min_lr_frac: float = 0.1
    gamma: float = 7.0
    clip: float = 1.0
    seed: int = 0
    save_every: int = 200
    log_every: int = 10
    # Stop (saving the state) at the first step that ends past this many seconds; running the same
    # request again continues from there, so a long run can be spread over several sittings.
    time_limit_s: float | None = None
    # architecture
    num_layers: int = 2
    layer_ids: list[int] | None = None     # target taps used, a subset of the feature store's (None: all)
    block_size: int = 16
    intermediate_size: int | None = None   # None: the target's (as are the head counts)
    num_heads: int | None = None
    num_kv_heads: int | None = None
    mask_token_id: int = 16
    # Domino head (head=False: a plain DFlash drafter)
    head: bool = False
    shift_label: bool = False
    emb_dim: int = 128
    gru_hidden_dim: int = 256
    pure_draft_prefix_len: int = 1
    anchor_fusion: bool = False   # feed the feature before the root into the block too (drafters/dflash.py)
    curriculum: bool = True       # lambda 1 -> 0 linearly; False: final-logit loss only
    ttt: bool = False             # GRU fed its own drafts instead of the ground truth
    init_from: str | None = None  # start from a trained drafter checkpoint dir (backbone; head too if both have one)
    init_layers: str = "random"   # "target": draft layers start as the target's last layers (train/target_init.py)
    head_from: str | None = None  # the head's starting weights from this Domino checkpoint (backbone from init_from)
    # Domino: train the head only, on a fixed backbone (a trained DFlash one): its base logits stay
    # what a marginal tree scores well, and the head learns the path correction on top of them.
    freeze_backbone: bool = False
    # "data": the softmax of the loss runs over the tokens that occur in the training data (~10k of
    # SmolLM2's 49k; the LM-head product is most of a step's cost) plus `negatives` other tokens drawn
    # afresh each step, so that the drafter also learns to keep the unseen ones down. "full": all tokens.
    vocab: str = "data"
    vocab_min_count: int = 1       # "data" vocabulary: tokens seen at least this often (rarer labels are ignored)
    # "data" vocabulary: only the vocab_top tokens the responses hold most often (0: no cap), the
    # set `draft_vocab=N` drafts from at inference; the LM-head product shrinks with it
    vocab_top: int = 0
    negatives: int = 2048
    # Distillation: loss = (1 - distill) * CE(data token) + distill * CE(target's renormalised top-k),
    # from the feature store's cached top-k (`train features --topk K`). Soft labels carry the
    # target's whole ranking, and on sampled responses its greedy choice, not the sampled token.
    distill: float = 0.0
    # "bf16": matmuls under bf16 autocast (fp32 master weights), ~2x faster where the CPU has AMX;
    # "fp32": no autocast, faster on CPUs without AMX (docs/TRAINING.md, measured costs).
    precision: str = "bf16"
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        # a bad value fails here, before the target and the feature store load, not steps into a run
        for name, low in (("steps", 1), ("seqs_per_step", 1), ("anchors_per_seq", 1), ("save_every", 1),
                          ("log_every", 1), ("num_layers", 1), ("block_size", 2), ("mask_token_id", 0),
                          ("emb_dim", 1), ("gru_hidden_dim", 1), ("pure_draft_prefix_len", 0), ("negatives", 0),
                          ("vocab_min_count", 1), ("vocab_top", 0)):
            _check_int(name, getattr(self, name), low)
        for name in ("intermediate_size", "num_heads", "num_kv_heads"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        if self.pure_draft_prefix_len >= self.block_size:
            raise ValueError(f"pure_draft_prefix_len must be below block_size ({self.block_size}), "
                             f"got {self.pure_draft_prefix_len}")
        for name, low, high, low_open in (("lr", 0, math.inf, False), ("weight_decay", 0, math.inf, False),
                                          ("warmup_frac", 0, 1, False), ("min_lr_frac", 0, 1, False),
                                          ("gamma", 0, math.inf, True), ("clip", 0, math.inf, True),
                                          ("distill", 0, 1, False)):
            v = getattr(self, name)
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v > high
                    or v < low or (low_open and v == low)):
                span = f"{'>' if low_open else '>='} {low}" + ("" if high == math.inf else f" and <= {high}")
                raise ValueError(f"{name} must be a finite number {span}, got {v!r}")
        if self.time_limit_s is not None and not (isinstance(self.time_limit_s, (int, float))
                                                  and self.time_limit_s >= 0):
            raise ValueError(f"time_limit_s must be >= 0 seconds (or None), got {self.time_limit_s!r}")
        for name, choices in (("vocab", ("data", "full")), ("precision", ("bf16", "fp32")),
                              ("init_layers", ("random", "target"))):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {getattr(self, name)!r}")
        if self.freeze_backbone and not self.head:
            raise ValueError("freeze_backbone trains the head only: it needs a Domino run with a head")
        if self.layer_ids is not None and (not self.layer_ids or len(set(self.layer_ids)) != len(self.layer_ids)):
            raise ValueError(f"layer_ids must be distinct target layers (or None: the store's), got {self.layer_ids}")


# what may change when a run continues: its length, where it pauses, the CPU's number format (and
# the spelling of its path)
CONTINUE_MAY_CHANGE = ("out", "steps", "time_limit_s", "precision")


def _check_same_run(out: Path, tc: TrainConfig) -> None:
    """A run dir continues only the run it holds: another recipe would resume its weights and
    optimiser under new settings and rewrite train_config.json to claim them."""
    path = out / "train_config.json"
    if not path.is_file():
        return
    held, now = json.loads(path.read_text()), json.loads(json.dumps(asdict(tc)))
    differ = [k for k in now if k not in CONTINUE_MAY_CHANGE and k in held and held[k] != now[k]]
    if differ:
        raise ValueError(f"{out} holds a run started with {', '.join(f'{k}={held[k]!r}' for k in differ)}, not "
                         f"{', '.join(f'{k}={now[k]!r}' for k in differ)}; only --steps and --time-limit change "
                         f"when a run continues: give a new run another --out")


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def drafter_config(tc: TrainConfig, target, layer_ids) -> DrafterConfig:
    t = target.config
    rope = getattr(t, "rope_parameters", None) or {}
    heads = tc.num_heads or t.num_attention_heads
    kv = tc.num_kv_heads or getattr(t, "num_key_value_heads", heads)
    return DrafterConfig(
        hidden_size=target.hidden_size, num_hidden_layers=tc.num_layers, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=target.hidden_size // heads,
        intermediate_size=tc.intermediate_size or t.intermediate_size, vocab_size=target.vocab_size,
        num_target_layers=target.num_layers, target_layer_ids=list(layer_ids), mask_token_id=tc.mask_token_id,
        block_size=tc.block_size, rms_norm_eps=float(getattr(t, "rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", getattr(t, "rope_theta", 10000.0))),
        max_position_embeddings=target.max_context,
        projector_type="domino" if tc.head else None, emb_dim=tc.emb_dim, gru_hidden_dim=tc.gru_hidden_dim,
        pure_draft_prefix_len=tc.pure_draft_prefix_len, shift_label=tc.shift_label, anchor_fusion=tc.anchor_fusion)


def lr_at(step: int, tc: TrainConfig) -> float:
    warm = max(1, int(tc.warmup_frac * tc.steps))
    if step < warm:
        return tc.lr * (step + 1) / warm
    p = (step - warm) / max(1, tc.steps - warm)
    return tc.lr * (tc.min_lr_frac + (1 - tc.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))


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
        _check_same_run(out, tc)
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
