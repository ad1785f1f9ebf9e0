"""Start a drafter's layers from the target's last layers instead of from random weights.

The drafter's layers have the target's shapes (hidden, heads, MLP width), so the target's top
`n` decoder layers can seed them: they already turn a late residual stream into next-token
features. `fc` starts by passing the deepest tapped layer's output through unchanged (the other
taps' columns at zero: their gradients do not depend on the weights, so they still learn) and `hidden_norm` takes the first copied layer's input norm, so the first
draft layer's context keys/values start as the target's own at that depth (up to the drafter's
q/k norms, which a Llama target lacks and which start at one)."""
from __future__ import annotations

import torch

_LINEARS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
_NORMS = ("input_layernorm", "post_attention_layernorm")


def target_decoder_layers(target) -> list:
    layers = getattr(target.model.base_model, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(target.model).__name__}")
    return list(layers)


@torch.no_grad()
def init_from_target_layers(backbone, target) -> list[int]:
    """Copy the target's last len(backbone.layers) layers into the backbone; returns their indices."""
    layers = target_decoder_layers(target)
    n = len(backbone.layers)
    src = list(range(len(layers) - n, len(layers)))
    for draft, i in zip(backbone.layers, src):
        t = layers[i]
        for part, names in _LINEARS.items():
            for name in names:
                dst, w = getattr(getattr(draft, part), name).weight, getattr(getattr(t, part), name).weight
                if dst.shape != w.shape:
                    raise ValueError(f"draft {part}.{name} {tuple(dst.shape)} does not fit target layer {i}'s "
                                     f"{tuple(w.shape)}: use the target's head counts and MLP width")
                dst.copy_(w.float())
        for name in _NORMS:
            getattr(draft, name).weight.copy_(getattr(t, name).weight.float())
    h = backbone.config.hidden_size
    k = len(backbone.config.target_layer_ids)
    deepest = max(range(k), key=lambda j: backbone.config.target_layer_ids[j])
    backbone.fc.weight.zero_()
    backbone.fc.weight[:, deepest * h:(deepest + 1) * h] = torch.eye(h)
    backbone.hidden_norm.weight.copy_(layers[src[0]].input_layernorm.weight.float())
    return src
