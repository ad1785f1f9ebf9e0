"""Method specs for the benchmark: `name[:key=value,...]`, presets, and the Hugging Face peers.

A spec's label is how it appears in every table; its options override the run-wide ones
(`--budget`). `drafter=dflash|domino` picks the drafter, `pack=0` runs the method (`ar` too) on
the plain linears instead of the pre-packed ones, `gqa=0` on transformers' `sdpa` attention
instead of the packed GQA one, `lean=0` drafts on the drafter's module path instead of its lean
one and `lean_target=0` steps the target (`ar` too) on transformers' forward instead of its lean
path, `tree_attention=0` (`ar` too) attends on SDPA instead of the bf16 tree-attention kernel in
tree verifies and one-token steps (interleaved A/Bs of those fast paths); the rest are SpecConfig fields."""
from __future__ import annotations

import time
from dataclasses import dataclass, field, fields

import torch

from ..config import ADAPTIVE_METHODS, METHODS, SpecConfig

HF_PEERS = ("hf-ar", "hf-prompt-lookup")
ALL_METHODS = METHODS + HF_PEERS
DOMINO_METHODS = ("domino", "dominotree", "condadaptive")      # default to the Domino drafter
RUN_WIDE = {"method", "temperature", "max_new_tokens", "seed", "stop", "raw"}   # set by the runner
SWITCHES = ("pack", "gqa", "lean", "lean_target", "tree_attention")  # on/off fast paths
AR_SWITCHES = ("pack", "gqa", "lean_target", "tree_attention")       # the only options `ar` takes (it drafts nothing)
PRESETS = {
    "ladder": ["ddtree:drafter=domino", "dominotree:conditioning=greedy", "dominotree"],
    "topm": [f"dominotree:corr_topm={m}" for m in (8, 16, 32, 64)] + ["dominotree:corr_topm=full"],
    "budget": [f"{m}:budget={b}" for m in ("dominotree", "ddtree") for b in (8, 16, 32, 64, 128)],
    "norm": ["dominotree:normalization=topm", "dominotree:normalization=exact"],
    "lookup": [f"{m}{lk}" for m in ("dflash", "ddtree", "dominotree") for lk in ("", ":lookup=8")]
    + ["hf-prompt-lookup"],
}


@dataclass(frozen=True)
class MethodSpec:
    label: str                                   # as shown in tables, e.g. "dominotree:budget=32"
    method: str                                  # an engine method or an HF peer
    options: dict = field(default_factory=dict)  # SpecConfig overrides
    drafter: str | None = None                   # "dflash" | "domino" | None (ar, peers)
    packed: bool = True                          # False: run on the plain linears (`pack=0`, see packed.py)
    gqa: bool = True                             # False: transformers' sdpa (`gqa=0`, see gqa_attention.py)
    lean: bool = True                            # False: the drafter's module path (`lean=0`, see drafters/lean.py)
    lean_target: bool = True                     # False: transformers' forward for the target (see lean_target.py)
    tree_attention: bool = True                  # False: SDPA for verifies and steps (tree_attention.py)

    @property
    def is_peer(self) -> bool:
        return self.method in HF_PEERS

    @property
    def needs_cost_model(self) -> bool:
        return self.method in ADAPTIVE_METHODS and "cost_model" not in self.options

    def config(self, budget: int) -> dict:
        """The generation options of this spec (run-wide knobs excluded)."""
        if self.is_peer or self.method == "ar":
            return {}
        return {"budget": budget, **self.options}


def _value(key: str, text: str):
    low = text.strip().lower()
    if low in ("none", "full") or (key == "corr_topm" and low == "0"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text.strip()


def parse_method(spec: str) -> MethodSpec:
    """`dominotree:budget=32,corr_topm=16` -> MethodSpec; one clear ValueError for bad specs."""
    spec = spec.strip()
    name, _, rest = spec.partition(":")
    if name not in ALL_METHODS:
        raise ValueError(f"unknown method {name!r} in {spec!r}; choose from {', '.join(ALL_METHODS)}")
    options, drafter, switches = {}, None, dict.fromkeys(SWITCHES, True)
    allowed = {f.name for f in fields(SpecConfig)} - RUN_WIDE
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, val = item.partition("=")
        key = key.strip()
        if not eq:
            raise ValueError(f"method option {item!r} in {spec!r} is not key=value")
        if name in HF_PEERS or (name == "ar" and key not in AR_SWITCHES):
            raise ValueError(f"method {name!r} takes no options{' but ' + ', '.join(AR_SWITCHES) if name == 'ar' else ''} (got {spec!r})")
        if key in SWITCHES:
            if val.strip().lower() not in ("0", "1", "false", "true"):
                raise ValueError(f"{key} must be 0 or 1 in {spec!r}")
            switches[key] = val.strip().lower() in ("1", "true")
        elif key == "drafter":
            if val.strip() not in ("dflash", "domino"):
                raise ValueError(f"drafter must be dflash or domino in {spec!r}")
            drafter = val.strip()
        elif key in allowed:
            options[key] = _value(key, val)
        else:
            raise ValueError(f"unknown option {key!r} in {spec!r}; choose from drafter, {', '.join(SWITCHES)}, "
                             f"{', '.join(sorted(allowed))}")
    if name != "ar" and name not in HF_PEERS:
        drafter = drafter or ("domino" if name in DOMINO_METHODS else "dflash")
        if name in DOMINO_METHODS and drafter != "domino":
            raise ValueError(f"method {name!r} needs the Domino drafter (got {spec!r})")
        try:
            SpecConfig(method=name, **options)
        except TypeError as e:
            raise ValueError(f"bad option value in {spec!r}: {e}") from e
    return MethodSpec(spec, name, options, drafter, packed=switches["pack"], gqa=switches["gqa"],
                      lean=switches["lean"], lean_target=switches["lean_target"],
                      tree_attention=switches["tree_attention"])


def expand_methods(methods: str | None, preset: str | None) -> list[MethodSpec]:
    """`ar` first (the baseline), then the listed methods, then the preset's; duplicates dropped."""
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    names = [] if methods is None and preset else (methods or ",".join(ALL_METHODS)).split(",")
    if preset:
        names += PRESETS[preset]
    # a comma separates methods and options alike: glue `key=value` pieces onto the spec before them
    specs: list[str] = []
    for piece in (n.strip() for n in names if n.strip()):
        if "=" in piece and ":" not in piece and specs:
            specs[-1] += "," + piece
        else:
            specs.append(piece)
    if not specs:
        raise ValueError(f"--methods {methods!r} names no method")
    out, seen = [parse_method("ar")], {"ar"}
    for s in specs:
        m = parse_method(s)
        if m.label not in seen:
            seen.add(m.label)
            out.append(m)
    return out


@torch.inference_mode()
def run_hf_peer(target, spec: MethodSpec, text: str, temperature: float, max_new_tokens: int,
                seed: int) -> tuple[list[int], float]:
    """One transformers `generate` call (plain, or prompt lookup) on the chat-templated prompt; the new
    tokens up to EOS and the wall seconds (prompt encoding included, as in `dt.generate`). The peers
    run the stock transformers modules, without the packed weights dominotree's own methods use."""
    eos = sorted(target.eos_token_ids)
    pad = getattr(target.tokenizer, "pad_token_id", None)
    kw = dict(do_sample=temperature > 0, temperature=temperature if temperature > 0 else 1.0, top_k=0, top_p=1.0,
              max_new_tokens=max_new_tokens, pad_token_id=pad if pad is not None else eos[0], eos_token_id=eos)
    if spec.method == "hf-prompt-lookup":
        kw["prompt_lookup_num_tokens"] = 10
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    ids = torch.tensor([target.encode_prompt(text)], device=target.device)
    with target.stock():
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    wall = time.perf_counter() - t0
    new = out[0, ids.shape[1]:].tolist()
    cut = next((i + 1 for i, t in enumerate(new) if t in target.eos_token_ids), len(new))
    return new[:cut], wall
