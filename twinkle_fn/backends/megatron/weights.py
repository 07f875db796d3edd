"""A megatron train state's parameters as whole HF tensors, and waiting for the parameter
gathers a step left in flight before they are read."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from twinkle_fn.backends.buckets import persistent_buffers
from twinkle_fn.backends.megatron import lora, param_sync
from twinkle_fn.backends.megatron.bridge import mcore_to_hf
from twinkle_fn.backends.megatron.placement import model_placement
from twinkle_fn.models.families import family
from twinkle_fn.models.model import Model
from twinkle_fn.state import TrainState


def settle(model: Model) -> None:
    """Wait for the parameter all-gathers a `step` left in flight (``overlap_param_gather``),
    so that the parameters can be read or written outside a forward. Raises ``ValueError``
    for a model not prepared by the megatron backend."""
    placement = model_placement(model)
    if placement.overlap_param_gather:
        param_sync.finish(placement.chunks)


def full_weights(state: TrainState, *, buffers: bool = True) -> dict[str, Tensor]:
    """Every parameter as a whole HF tensor, by HF checkpoint name (a collective); with
    `buffers`, the untrained checkpoint tensors too (a router's expert bias).

    Gathers one copy of each tp / pp / ep shard on every rank and joins them with the bridge's
    `mcore_to_hf` (MoE experts come out one tensor per expert). CPU tensors in the model's
    parameter dtype. A model that trains LoRA adapters gives the adapters, keyed as in a peft
    adapter file (`twinkle_fn.backends.megatron.lora.adapter_state_dict`).
    """
    placement = model_placement(state.model)
    settle(state.model)
    if placement.lora is not None:
        return lora.adapter_state_dict(state)
    mesh, rank = placement.mesh, dist.get_rank()
    coords, expert = mesh.coords(rank), mesh.expert_coords(rank)
    sends_dense = mesh.data_rank(rank) == 0 and coords["cp"] == 0
    sends_expert = expert["edp"] == 0
    local = {
        n: p.detach().cpu()
        for n, p in checkpoint_tensors(placement.module).items()
        if (sends_expert if is_expert(p) else sends_dense)
    }
    key = (coords["tp"], coords["pp"], expert["ep"], expert["etp"])
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (key, sends_dense, local))
    dense = {k[:2]: part for k, is_dense, part in gathered if is_dense}
    states = {k: {**dense[k[:2]], **part} for k, _, part in gathered if part}
    whole = dict(
        mcore_to_hf(
            states,
            placement.hf_config,
            tp_size=mesh.tp,
            pp_size=mesh.pp,
            ep_size=mesh.ep,
            etp_size=mesh.etp,
            vocab_multiple=placement.vocab_multiple,
            head=placement.head,
        )
    )
    moe = family(placement.hf_config).moe
    if buffers or moe is None or moe.expert_bias is None:
        return whole
    bias = f".{moe.router}.{moe.expert_bias}"
    return {n: t for n, t in whole.items() if not n.endswith(bias)}


def checkpoint_tensors(module: torch.nn.Module) -> dict[str, Tensor]:
    """`module`'s parameters and persistent buffers by megatron name: what the bridge maps to
    HF tensors (a buffer such as the router's ``expert_bias`` is part of the checkpoint)."""
    return {**persistent_buffers(module), **dict(module.named_parameters())}


def is_expert(param: Tensor) -> bool:
    """Whether `param` is expert-parallel (megatron marks those with ``allreduce=False``)."""
    return not getattr(param, "allreduce", True)
