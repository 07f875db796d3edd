"""Weights out of a megatron-backend state as a stream of HF-named buckets (`twinkle_fn.export`).

Pipeline stages are streamed in turn. The ranks of the stage that owns a tensor build it whole:
tensor-parallel shards are all-gathered within the tp group (expert shards within the expert-tp
group) and joined by the bridge's transforms (fused qkv and gate-up split back, vocabulary
padding trimmed; `twinkle_fn.backends.megatron.bridge`), and each expert tensor is all-gathered
within the expert-parallel group, so that every rank of the stage holds every expert. The stage
cuts that stream into buckets and broadcasts each bucket over the pipeline group (names and
shapes first, as a small object), so every rank of every stage yields the same buckets. No rank
holds more than the current bucket, the tensor being gathered and (with ep) one expert tensor per
ep rank. Collectives involve only the groups that hold a tensor (tp / expert-tp / ep within a
stage, then pp), and every data- and context-parallel replica runs its own.

The module holds the weights in the compute dtype (bf16 under mixed precision); they are cast to
the export dtype before being gathered. LoRA (`twinkle_fn.backends.megatron.lora`): ``"merged"``
merges each rank's own shard before the gather, in float32 (``W + scaling * B @ A`` splits like
``W``: a column linear's ``B`` and ``W`` by rows, a row linear's ``A`` and ``W`` by columns);
``"separate"`` streams the factors with peft's file names, as `lora.adapter_state_dict` does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import Tensor

from twinkle_fn.backends.buckets import Bucket, buckets
from twinkle_fn.backends.megatron.bridge_layout import _layout, _slots
from twinkle_fn.backends.megatron.bridge_to_hf import _join, join_shards
from twinkle_fn.backends.megatron.fp8_linears import dense_weight
from twinkle_fn.backends.megatron.lora_linear import LoraParallelLinear
from twinkle_fn.backends.megatron.lora_peft import expert_factor_name, expert_factors_to_peft
from twinkle_fn.backends.megatron.lora_targets import hf_modules, layer_linears
from twinkle_fn.backends.megatron.placement import MegatronPlacement, model_placement
from twinkle_fn.backends.megatron.weights import checkpoint_tensors, settle
from twinkle_fn.lora import PEFT_PREFIX
from twinkle_fn.state import TrainState

Named = Iterator[tuple[str, Tensor]]


def export_weights(
    state: TrainState, dtype: torch.dtype, bucket_bytes: int, lora: str
) -> Iterator[Bucket]:
    """See `twinkle_fn.export.export_weights`; the module docstring says how. Raises
    ``ValueError`` (eagerly) for a model not prepared by this backend."""
    placement = model_placement(state.model)
    settle(state.model)
    return _stream(placement, dtype, bucket_bytes, lora)


def _stream(
    placement: MegatronPlacement, dtype: torch.dtype, bucket_bytes: int, lora: str
) -> Iterator[Bucket]:
    stage = parallel_state.get_pipeline_model_parallel_rank()
    device = next(placement.module.parameters()).device
    for owner in range(placement.mesh.pp):
        mine = None
        if owner == stage:
            if placement.lora is not None and lora == "separate":
                named = _adapter(placement, owner, dtype)
            else:
                named = _weights(placement, owner, dtype)
            mine = buckets(named, bucket_bytes)
        yield from _from_stage(mine, owner, dtype, device)


def _from_stage(
    mine: Iterator[Bucket] | None, owner: int, dtype: torch.dtype, device: torch.device
) -> Iterator[Bucket]:
    """Stage `owner`'s buckets: `mine` on its ranks (None elsewhere), broadcast over the pipeline
    group one bucket at a time, names and shapes first; None in their place ends the stage."""
    group = parallel_state.get_pipeline_model_parallel_group()
    if mine is not None and dist.get_world_size(group) == 1:
        yield from mine
        return
    src = dist.get_global_rank(group, owner)
    while True:
        bucket = None if mine is None else next(mine, None)
        meta = [None if bucket is None else [(n, tuple(t.shape)) for n, t in bucket]]
        dist.broadcast_object_list(meta, src=src, group=group, device=device)
        if meta[0] is None:
            return
        if bucket is None:
            bucket = [(n, torch.empty(s, dtype=dtype, device=device)) for n, s in meta[0]]
        for _, tensor in bucket:
            dist.broadcast(tensor, src=src, group=group)
        yield bucket


def _gather(tensor: Tensor, group: dist.ProcessGroup) -> list[Tensor]:
    """Every rank of `group`'s `tensor`, in group-rank order (a collective over `group`)."""
    size = dist.get_world_size(group)
    if size == 1:
        return [tensor]
    tensor = tensor.contiguous()
    out = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(out, tensor, group=group)
    return out


def _weights(placement: MegatronPlacement, stage: int, dtype: torch.dtype) -> Named:
    """Stage `stage`'s whole HF tensors (on its ranks: collectives over tp, etp and ep)."""
    mesh = placement.mesh
    rules, model, lay = _layout(
        placement.hf_config,
        mesh.tp,
        mesh.pp,
        mesh.ep,
        mesh.etp,
        placement.vocab_multiple,
        placement.head,
    )
    local = _local(placement)
    tp = parallel_state.get_tensor_model_parallel_group()
    etp = parallel_state.get_expert_tensor_parallel_group()
    ep = parallel_state.get_expert_model_parallel_group()
    my_ep = parallel_state.get_expert_model_parallel_rank()
    # The same tensors on every ep rank, but each holds its own experts: one row per slot.
    rows = zip(*(list(_slots(rules, model, lay, stage, (e,))) for e in range(lay.ep)), strict=True)
    for row in rows:
        slot = row[my_ep]
        rule = slot.rule
        if rule.tied:  # megatron's copy of a tied embedding on the last stage
            continue
        shard = local(slot.mcore).to(dtype)
        shards = [shard] if rule.tp_dim is None else _gather(shard, etp if rule.expert else tp)
        joined = _join(rule, slot.hf, shards, model)
        if not rule.expert or lay.ep == 1:
            yield from ((name, t.contiguous()) for name, t in joined)
            continue
        for k, (_, tensor) in enumerate(joined):
            for e, part in enumerate(_gather(tensor, ep)):
                yield row[e].hf[k], part


def _local(placement: MegatronPlacement) -> Callable[[str], Tensor]:
    """This rank's tensor of a megatron name; a LoRA-wrapped linear's or a routed expert's
    weight with its adapter's update merged in (float32)."""
    params = checkpoint_tensors(placement.module)
    modules = dict(placement.module.named_modules())

    def get(name: str) -> Tensor:
        if name in params:
            base = params[name].detach()
            experts, _, rest = name.partition(".local_experts.")  # rest: "3.linear_fc1.weight"
            if not rest.endswith(".weight"):
                return base
            j, part, _ = rest.split(".")
            lora = modules.get(f"{experts}.lora_{part.removeprefix('linear_')}")
            if lora is None:
                return base
            update = lora.lora_B[int(j)].detach().float() @ lora.lora_A[int(j)].detach().float()
            return base.float() + lora.scaling * update
        path, leaf = name.rsplit(".", 1)
        layer = modules.get(path)
        if not isinstance(layer, LoraParallelLinear):
            raise KeyError(f"megatron tensor {name!r} is not on this rank")
        if leaf != "weight":
            return getattr(layer.base_layer, leaf).detach()
        base = dense_weight(layer.base_layer)
        update = layer.lora_B.weight.detach().float() @ layer.lora_A.weight.detach().float()
        return base.float() + layer.scaling * update

    return get


def _adapter(placement: MegatronPlacement, stage: int, dtype: torch.dtype) -> Named:
    """Stage `stage`'s adapter factors, whole, with peft's file names (collectives over tp, and
    over ep for the routed experts')."""
    plan, config = placement.lora, placement.hf_config
    assert plan is not None  # only called for a model training adapters
    per_stage = config.num_hidden_layers // placement.mesh.pp
    params = dict(placement.module.named_parameters())
    tp = parallel_state.get_tensor_model_parallel_group()
    rules = layer_linears(config)
    for layer, keys in sorted(plan.layers.items()):
        owner, local = divmod(layer, per_stage)
        if owner != stage:
            continue
        for key in keys:
            rule = rules[layer][key]
            prefix = f"decoder.layers.{local}.{key}."
            a, b = (params[prefix + f"lora_{f}.weight"].detach().to(dtype) for f in "AB")
            modules = hf_modules(rule, layer)
            names_a = [f"{m}.lora_A.weight" for m in modules]
            names_b = [f"{m}.lora_B.weight" for m in modules]
            if rule.tp_dim == 0:  # column: A replicated, B split like the base weight
                pairs = [
                    *((n, a) for n in names_a),
                    *join_shards(rule, names_b, _gather(b, tp), config),
                ]
            else:  # row: A split like the base weight, B replicated
                pairs = [*join_shards(rule, names_a, _gather(a, tp), config), (names_b[0], b)]
            for name, tensor in pairs:
                # Own storage for each: the q/k/v parts are views, A is shared by them.
                yield PEFT_PREFIX + name, tensor.clone()
    ep = parallel_state.get_expert_model_parallel_group()
    for layer, parts in sorted(plan.experts.items()):
        owner, local = divmod(layer, per_stage)
        if owner != stage:
            continue
        for part in parts:
            prefix = expert_factor_name(local, part) + "."
            a, b = (
                torch.cat(_gather(params[prefix + f"lora_{f}"].detach().to(dtype), ep))
                for f in "AB"
            )
            yield from expert_factors_to_peft(plan, layer, part, a, b)
