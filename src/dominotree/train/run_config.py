"""One training run's settings (TrainConfig), checked when made; the drafter architecture and the
learning-rate schedule that follow from them; and the rule for continuing a run in its dir."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..config import check_int
from ..drafters import DrafterConfig


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
            check_int(name, getattr(self, name), low)
        for name in ("intermediate_size", "num_heads", "num_kv_heads"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
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


def check_same_run(out: Path, tc: TrainConfig) -> None:
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
