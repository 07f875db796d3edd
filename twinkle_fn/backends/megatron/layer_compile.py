"""The option ``compile_layers`` on megatron decoder layers, MoE layers included.

A dense layer compiles whole (`twinkle_fn.backends.compile_layers`). An MoE layer cannot: its
token dispatcher sizes its all-to-alls and its permutation from the routing, so it copies the
tokens-per-expert counts to the host on a side CUDA stream (``record_stream``, events, a
synchronisation). Inductor cannot functionalise ``aten::record_stream``, so tracing into the
dispatcher fails the whole layer; and were it traceable, every step's new counts would be new
shapes to specialise on. So the MoE block's forward stays eager (one graph break at its call:
the layer compiles as the attention half and the residual after the MoE block), and the parts
of the block with static shapes compile on their own: the router (a linear, softmax / sigmoid
and top-k over every token) and the shared expert. The routed experts run eager: their work is
two grouped GEMMs over a data-dependent number of tokens, already one kernel each
(`twinkle_fn.backends.megatron.grouped_experts`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer

from twinkle_fn.backends.compile_layers import compile_layers


def compile_decoder_layers(layers: Iterable[torch.nn.Module], setting: object) -> None:
    """``torch.compile`` each megatron ``TransformerLayer`` of `layers` in place as the module
    docstring says (`setting`: the option's value, as for
    `twinkle_fn.backends.compile_layers.compile_layers`; ``False`` leaves them eager).

    Raises ``TypeError`` for another `setting` (before changing any layer).
    """
    if setting is False:
        return
    layers = list(layers)
    for layer in layers:
        moe = getattr(layer, "mlp", None)
        if isinstance(moe, MoELayer):
            _keep_dispatch_eager(moe, setting)
    compile_layers(layers, setting)


def _keep_dispatch_eager(moe: MoELayer, setting: object) -> None:
    """Compile `moe`'s router and shared expert on their own and run the rest of its forward
    (dispatch, routed experts, combine) eagerly, also when its layer is compiled."""
    parts = [moe.router] + ([moe.shared_experts] if moe.shared_experts is not None else [])
    compile_layers(parts, setting)
    if not getattr(moe.forward, "_torchdynamo_disable", False):
        # An instance attribute: this layer's block only, and the compiled router / shared
        # expert it calls still run their own graphs (a nested compiled module re-enters
        # dynamo).
        moe.forward = torch._dynamo.disable(moe.forward, reason="MoE token dispatch")
