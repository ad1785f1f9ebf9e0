"""Start a larger drafter from a trained smaller one, computing exactly what the smaller one did.

Two ways to add capacity to a trained backbone without losing what it learned:
- more layers: the new layers are appended after the trained ones with their output projections
  (`o_proj`, `down_proj`) at zero, so each starts as the identity on the residual stream;
- more target taps: `fc` keeps the trained columns of the taps both have, and the new taps'
  columns start at zero (their gradients do not depend on those weights, so they still learn);
- anchor fusion: `anchor_scale` starts at zero, adding nothing to the block inputs.
At step 0 the grown drafter's drafts are the trained one's; training then tells whether the
added capacity helps (docs/TRAINING.md, the growth probe)."""
from __future__ import annotations

import torch

from ..drafters import DFlashBackbone


def _check(dst: DFlashBackbone, src: DFlashBackbone) -> None:
    d, s = dst.config, src.config
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
        if getattr(d, key) != getattr(s, key):
            raise ValueError(f"cannot grow from a drafter with {key} {getattr(s, key)} into one with {getattr(d, key)}")
    if s.anchor_fusion and not d.anchor_fusion:
        raise ValueError("cannot grow an anchor-fusion drafter into one without anchor fusion")
    if s.num_hidden_layers > d.num_hidden_layers:
        raise ValueError(f"cannot grow {s.num_hidden_layers} draft layers into {d.num_hidden_layers}")
    missing = [i for i in s.target_layer_ids if i not in d.target_layer_ids]
    if missing:
        raise ValueError(f"the new drafter drops target taps {missing} of the one it grows from "
                         f"({s.target_layer_ids} -> {d.target_layer_ids})")


@torch.no_grad()
def grow_backbone(dst: DFlashBackbone, src: DFlashBackbone) -> dict:
    """Copy src into dst (same or more layers, same or more taps); returns what was added."""
    _check(dst, src)
    h = dst.config.hidden_size
    for a, b in zip(dst.layers, src.layers):
        a.load_state_dict(b.state_dict())      # copies into dst's tensors, in dst's dtype
    new_layers = list(range(src.config.num_hidden_layers, dst.config.num_hidden_layers))
    for i in new_layers:
        dst.layers[i].self_attn.o_proj.weight.zero_()
        dst.layers[i].mlp.down_proj.weight.zero_()
    dst.fc.weight.zero_()
    for j, layer_id in enumerate(src.config.target_layer_ids):
        k = dst.config.target_layer_ids.index(layer_id)
        dst.fc.weight[:, k * h:(k + 1) * h] = src.fc.weight[:, j * h:(j + 1) * h].to(dst.fc.weight.dtype)
    dst.hidden_norm.weight.copy_(src.hidden_norm.weight)
    dst.norm.weight.copy_(src.norm.weight)
    if dst.config.anchor_fusion:       # a new fusion starts at scale zero: the block inputs are unchanged
        if src.config.anchor_fusion:
            dst.anchor_proj.weight.copy_(src.anchor_proj.weight)
            dst.anchor_scale.copy_(src.anchor_scale)
        else:
            dst.anchor_scale.zero_()
    new_taps = [i for i in dst.config.target_layer_ids if i not in src.config.target_layer_ids]
    return {"new_layers": new_layers, "new_taps": new_taps,
            "new_fusion": dst.config.anchor_fusion and not src.config.anchor_fusion}
