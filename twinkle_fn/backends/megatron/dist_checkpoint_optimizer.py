"""The distributed optimizer's state in model space, as megatron-backend checkpoints hold it.

`optimizer_params` lays out, per parameter, its fp32 main copy and Adam moments as tensors shaped
and sharded like the parameter's own model tensor (keys
``optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<model key>``, as megatron's
``fully_reshardable`` format names them), so that a checkpoint of them reshards over tp, pp, ep
and dp on load; `optimizer_common` is the non-tensor state every rank shares (Adam's step, the
fp16 grad scaler's state); `load_optimizer` copies a loaded checkpoint's back into the
optimizer. `twinkle_fn.backends.megatron.dist_checkpoint` saves and loads them.

Why not ``DistributedOptimizer.sharded_state_dict``: in megatron-core 0.19 its
``fully_sharded_model_space`` format is refused by its own ``ShardedTensor`` (flattened ranges
are gone), and ``fully_reshardable`` saves the state of every parameter after the first bucket
of a buffer at the wrong offset (its gathered buffer drops the padding between buckets but is
indexed with padded offsets; a tied embedding on a pipeline stage has its own bucket), and on
load looks for torch Adam's ``step`` among the parameter tensors (KeyError). The layout here is
the same model-space one, built from the optimizer's own tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
from torch import Tensor

from twinkle_fn.backends.megatron.optimizer import MegatronOptState
from twinkle_fn.backends.megatron.placement import MegatronPlacement

# checkpoint name -> key of the main parameter's optimizer state (None: the main parameter)
_PARAM_STATE = {"fp32_param": None, "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


def _buffers(opt: MegatronOptState) -> Iterator[tuple[Any, Any]]:
    """``(sub-optimizer, grad buffer)`` of every buffer the optimizer steps, in the same order
    on every rank; a buffer's ``param_index_map`` gives each parameter's ``(start, end,
    bucket)`` in it, the same on every data-parallel rank."""
    for sub in opt.optimizer.chained_optimizers:
        for buffer in sub.buffers:
            yield sub, buffer


def _owned(sub: Any, param: Tensor) -> tuple[slice, dict[str, Tensor]] | None:
    """The flat range of `param` this data rank's optimizer owns and, by checkpoint name, the
    optimizer tensors of that range; None when another data rank owns all of it."""
    if param not in sub.model_param_gbuf_map:
        return None
    gbuf, dtype, bucket = sub.model_param_gbuf_map[param]
    span = sub.gbuf_ranges[gbuf][dtype][bucket]["param_map"][param]["param"]
    group, order = sub.model_param_group_index_map[param]
    main = sub.optimizer.param_groups[group]["params"][order]
    slot = sub.optimizer.state[main]
    tensors = {name: main if key is None else slot[key] for name, key in _PARAM_STATE.items()}
    return slice(span.start, span.end), tensors


def optimizer_params(
    placement: MegatronPlacement, opt: MegatronOptState, model: dict[str, Any], *, fill: bool
) -> dict[str, dict[str, Any]]:
    """Per parameter name, its optimizer tensors by checkpoint name (``fp32_param``,
    ``exp_avg``, ``exp_avg_sq``; float32, shaped as this rank's parameter) wrapped
    like the parameter's model ``ShardedTensor`` (or factory) in `model` (the module's
    ``sharded_state_dict()``, or part of it: every parameter the optimizer steps must be in it,
    else ``KeyError``), keyed ``optimizer.state.<name>.<model key>``. A collective over each
    data-parallel group with `fill`, where each data rank writes the ranges it owns into
    zeros and one all-reduce per buffer gathers them (a sum with one non-zero term is exact);
    without, they are zero targets for a load (zero stays where the checkpoint has no rows: a
    vocabulary padded further than on the saving mesh)."""
    sharded, _ = extract_sharded_tensors_and_factories(model)
    by_param = {id(sh.data): sh for sh in nested_values(sharded)}
    names = {id(p): n for n, p in placement.module.named_parameters()}
    out: dict[str, dict[str, Any]] = {}
    for sub, buffer in _buffers(opt):
        device = buffer.grad_data.device
        flat = {
            n: torch.zeros(buffer.numel, dtype=torch.float32, device=device) for n in _PARAM_STATE
        }
        for param, (start, _, _) in buffer.param_index_map.items():
            owned = _owned(sub, param) if fill else None
            if owned is not None:
                span, tensors = owned
                for name, tensor in tensors.items():
                    flat[name][start + span.start : start + span.stop] = tensor.detach().view(-1)
        if fill and sub.data_parallel_group.size() > 1:
            for tensor in flat.values():
                dist.all_reduce(tensor, group=sub.data_parallel_group)
        for param, (start, end, _) in buffer.param_index_map.items():
            sh = by_param[id(param)]
            out[names[id(param)]] = {
                name: _like(sh, f"optimizer.state.{name}.{sh.key}", t[start:end].view(param.shape))
                for name, t in flat.items()
            }
    return out


def _like(sh: Any, key: str, data: Tensor) -> Any:
    """`sh` (a model ``ShardedTensor`` or factory) for another tensor of the same shape."""
    if isinstance(sh, ShardedTensorFactory):
        return dataclasses.replace(sh, key=key, data=data)
    return dataclasses.replace(sh, key=key, data=data, dtype=data.dtype)


def optimizer_common(opt: MegatronOptState) -> dict[str, Any]:
    """The optimizer's non-tensor state every rank shares: Adam's step (as megatron reads it
    from torch's, TransformerEngine's or apex's Adam) and the fp16 grad scaler's state. The
    sub-optimizers of megatron's chain (dense, expert-parallel) differ with the mesh, so the
    first one's is saved and loaded into each."""
    first = opt.optimizer.chained_optimizers[0].state_dict()
    return {
        "step": first["optimizer"]["param_groups"][0].get("step"),
        "grad_scaler": first.get("grad_scaler"),
    }


def load_optimizer(placement: MegatronPlacement, opt: MegatronOptState, loaded: dict) -> None:
    """Copy `loaded` (``{"params": optimizer_params' layout with loaded tensors, "common":
    optimizer_common's}``) into `opt`, in place: this data rank's ranges of the loaded parameter
    state into the optimizer's tensors,
    then its step and grad scaler through megatron's ``load_state_dict`` (of each
    sub-optimizer's own state with those replaced, so its parameter groups match). That gives
    every parameter of torch's Adam one shared ``step`` tensor, which the per-parameter update
    would advance once per parameter: each parameter gets its own copy."""
    names = {id(p): n for n, p in placement.module.named_parameters()}
    with torch.no_grad():
        for sub, buffer in _buffers(opt):
            for param in buffer.param_index_map:
                owned = _owned(sub, param)
                if owned is None:
                    continue
                span, tensors = owned
                saved = loaded["params"][names[id(param)]]
                for name, tensor in tensors.items():
                    tensor.view(-1).copy_(saved[name].reshape(-1)[span])
    common = loaded["common"]
    for sub in opt.optimizer.chained_optimizers:
        state = sub.state_dict()
        if common["step"] is not None:
            for group in state["optimizer"]["param_groups"]:
                group["step"] = common["step"]
        if common["grad_scaler"] is not None:
            state["grad_scaler"] = common["grad_scaler"]
        sub.load_state_dict(state)
        for slot in sub.optimizer.state.values():
            if isinstance(slot.get("step"), Tensor):
                slot["step"] = slot["step"].clone()
