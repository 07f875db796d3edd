"""Dropping what megatron's MoE token dispatchers keep of the last forward.

A dispatcher stores the routing of the forward it last ran on itself (``probs``, ``token_probs``,
``local_probs``: the router's top-k probabilities, a tensor with autograd history). That history
reaches the router's weight and so the hook megatron's DDP registers on its gradient
accumulator, whose closure holds the DDP and with it the whole model. The path runs through
autograd's C++ nodes, which Python's garbage collector cannot traverse: a dropped MoE model
stayed alive, its parameters, gradient buffer and optimizer main parameters with it (at the
Qwen3-30B-A3B shape cut to two layers, 17.4 GiB on the GPU after the model was gone).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer


def drop_dispatch_history(chunks: Iterable[torch.nn.Module]) -> int:
    """Set to None every tensor with autograd history that an MoE layer's token dispatcher in
    `chunks` (model chunks, wrapped or not) holds as an attribute; the number dropped.

    Call it once a forward (and its backward) is done: a dispatcher reads these only between its
    dispatch and its combine, within one forward.
    """
    dropped = 0
    for chunk in chunks:
        for module in chunk.modules():
            if not isinstance(module, MoELayer):
                continue
            dispatcher = module.token_dispatcher
            for name, value in list(vars(dispatcher).items()):
                if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                    setattr(dispatcher, name, None)
                    dropped += 1
    return dropped
