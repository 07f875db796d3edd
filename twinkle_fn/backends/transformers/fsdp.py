"""Placing a transformers model on a mesh with PyTorch's own primitives.

Tensor parallelism is DTensor's ``parallelize_module`` with the family's plan
(`twinkle_fn.backends.transformers.plans`); data parallelism is FSDP2's ``fully_shard`` per decoder layer and at
the root:

- ``fsdp`` alone shards parameters, gradients and optimizer state, and reshards each layer's
  parameters after its forward (gathered again for its backward);
- ``dp`` alone shards gradients and optimizer state over the data ranks, as megatron's
  distributed optimizer does: parameters are gathered once per step and kept whole from forward
  through backward (ZeRO-2). Against replicated DDP this reduce-scatters gradients and gathers
  parameters instead of all-reducing gradients (fewer bytes over the wire) and steps the
  optimizer on 1/dp of the parameters; the sums are the same;
- both: shards over ``fsdp`` as above, replicated over ``dp`` (HSDP: parameter all-gathers stay
  within an fsdp group).

MoE experts under ``ep`` are split over the ep ranks first and sharded by FSDP2 over the ranks
holding the same experts (``edp``) only; see `twinkle_fn.backends.transformers.expert_parallel`.
Gradients are reduced as *sums* (divide factor 1): the core normalises once by the global token
count. ``ulysses`` ranks split each sequence and replicate the parameters; see
`twinkle_fn.backends.transformers.ulysses` for why (and how their gradients are summed).
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from transformers import PretrainedConfig

from twinkle_fn.backends import compile_layers as layer_compiler
from twinkle_fn.backends.transformers import expert_parallel, ulysses
from twinkle_fn.backends.transformers.plans import (
    COLWISE,
    SEQUENCE_PARALLEL_LAYER,
    SEQUENCE_PARALLEL_ROOT,
    data_axis,
    tp_plan,
    with_lora,
)
from twinkle_fn.backends.transformers.sharding import check_mesh
from twinkle_fn.distributed import world_size
from twinkle_fn.mesh import Mesh
from twinkle_fn.models.families import family
from twinkle_fn.models.model import Model


@dataclasses.dataclass(frozen=True, eq=False)
class Placement:
    """Where a model lives: the torch device mesh, the group of every rank holding other tokens
    (whose token sums the step adds up) and the ulysses group."""

    mesh: Mesh
    device_mesh: DeviceMesh
    dp_group: dist.ProcessGroup | None  # all ranks holding other tokens (dp x fsdp x ulysses)
    ulysses_group: dist.ProcessGroup | None = None


def device_mesh(mesh: Mesh) -> DeviceMesh:
    """The torch ``DeviceMesh`` of `mesh` with dims ``("dp", "fsdp", "ulysses", "tp")`` in our
    rank order.

    Raises ``ValueError`` for pp or cp > 1 (those belong to the Megatron backend) and when
    the mesh does not match the world.
    """
    check_mesh(mesh)
    mesh.validate(world_size())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(
        device,
        (mesh.dp, mesh.fsdp, mesh.ulysses, mesh.tp),
        mesh_dim_names=("dp", "fsdp", "ulysses", "tp"),
    )


def parallelize(model: Model, mesh: Mesh) -> Model:
    """Shard `model`'s module in place over `mesh`; returns the model with its placement.

    Its parameters become DTensors (new parameter objects: read them from the module again),
    but for frozen weights stored in float8 (``fp8_store_frozen``), which stay whole on each rank.
    Under ``ep`` the MoE experts split over the ep ranks first
    (`twinkle_fn.backends.transformers.expert_parallel`) and FSDP2 shards them over ``edp``.
    Raises ``ValueError``
    when tp does not divide the model's heads or features, ulysses its heads per tp rank, ep
    the experts (or the family has none), or for meshes the backend lacks.
    """
    module = model.module
    expert_parallel.check_expert_parallel(module.config, mesh)
    if mesh.ulysses > 1:
        ulysses.check_ulysses(module.config, mesh.ulysses, mesh.tp, mesh.sequence_parallel)
    dm = device_mesh(mesh)
    ulysses_group = None
    if mesh.ulysses > 1:
        ulysses_group = dm["ulysses"].get_group()
        ulysses.use_ulysses_attention(module, ulysses_group)
    layers = module.get_decoder().layers
    if mesh.tp > 1:
        # The plan `plans.param_specs` reads, with its data split over `plans.data_axis`: what
        # `tf.shard(params, mesh, model)` cuts (`sharding.shard_params`) is what this places.
        plan = tp_plan(module.config, mesh.tp)
        sp = mesh.sequence_parallel
        if sp:
            _check_sequence_parallel(model)
            parallelize_module(module, dm["tp"], _sp_styles(_sequence_parallel_root(model)))
        for layer in layers:
            layer_plan = with_lora(plan, (n for n, _ in layer.named_modules()))
            styles = {s: _tp_style(v, sp) for s, v in layer_plan.items()}
            if sp:
                styles.update(_sp_styles(SEQUENCE_PARALLEL_LAYER))
            if family(module.config).has_qk_norm(module.config):
                styles.update(_head_norm_styles(layer))
            styles.update(_shared_key_styles(layer, module.config))
            parallelize_module(layer, dm["tp"], styles)
    compile_layers(model)
    expert_dm, experts = None, []
    if mesh.ep > 1:
        expert_dm = expert_parallel.expert_device_mesh(mesh)
        experts = expert_parallel.shard_experts(layers, module.config, expert_dm, dm["tp"])
    if mesh.data_world_size > 1:
        data_mesh = _data_mesh(dm, mesh)
        mp = _mixed_precision(model.compute_dtype)
        # Frozen weights stored in float8 (option fp8_store_frozen) stay whole on each rank:
        # FSDP2 would cast them to the compute dtype for its all-gather, reading the bytes as
        # numbers without their scale.
        kept = {p for p in module.parameters() if p.dtype == torch.float8_e4m3fn}
        for m in experts:
            # Innermost first, so the layer's own FSDP2 group leaves the expert tensors alone:
            # they are sharded and reduced over the ranks holding the same experts only.
            fully_shard(m, mesh=expert_dm["edp"], mp_policy=mp, reshard_after_forward=mesh.fsdp > 1)
        for i, layer in enumerate(layers):
            # The last layer's backward runs right after the forward: keep it unsharded. dp alone
            # keeps every layer whole until its backward (ZeRO-2).
            last = i == len(layers) - 1
            reshard = mesh.fsdp > 1 and not last
            fully_shard(
                layer,
                mesh=data_mesh,
                mp_policy=mp,
                reshard_after_forward=reshard,
                ignored_params=kept,
            )
        fully_shard(module, mesh=data_mesh, mp_policy=mp, ignored_params=kept)
        _prefetch(module, list(layers))
        for m in module.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                # Plain SUM collectives: gloo has no PREMUL_SUM, and NCCL is zero-copy with SUM.
                m.set_force_sum_reduction_for_comms(True)
    placement = Placement(mesh, dm, _dp_group(mesh), ulysses_group)
    return dataclasses.replace(model, placement=placement)


def _data_mesh(dm: DeviceMesh, mesh: Mesh) -> DeviceMesh:
    """The mesh FSDP2 shards over: 1-D over `plans.data_axis` (fsdp, or dp when it is the only
    data axis); 2-D (replicate over dp, shard over fsdp) when both are > 1."""
    if mesh.dp > 1 and mesh.fsdp > 1:
        return dm["dp", "fsdp"]
    return dm[data_axis(mesh)]


def _prefetch(root: FSDPModule, layers: list[FSDPModule]) -> None:
    """Issue each layer's all-gather from the CPU one layer early, in forward and in backward.

    FSDP2's implicit prefetch issues a layer's all-gather when the CPU reaches that layer, which
    overlaps with compute only while the CPU runs ahead of the GPU; after a host sync (the fused
    loss counts its supervised tokens) or a slow optimizer dispatch it does not, and every
    all-gather waits exposed. Explicit prefetch issues it during the previous layer.
    """
    if layers:
        root.set_modules_to_forward_prefetch([layers[0]])
    for prev, nxt in itertools.pairwise(layers):
        prev.set_modules_to_forward_prefetch([nxt])
        nxt.set_modules_to_backward_prefetch([prev])


def compile_layers(model: Model) -> None:
    """Apply the model option ``compile_layers`` to its decoder layers (see
    `twinkle_fn.backends.compile_layers`). Raises ``TypeError`` for a bad value."""
    setting = model.options.get("compile_layers", False)
    layer_compiler.compile_layers(model.module.get_decoder().layers, setting)


def _tp_style(style: str, sequence_parallel: bool) -> ParallelStyle:
    if style == COLWISE:
        return ColwiseParallel()
    if sequence_parallel:  # reduce-scatter the output back to sequence shards
        return RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    return RowwiseParallel()


def _head_norm_styles(layer: torch.nn.Module) -> dict[str, ParallelStyle]:
    """The q/k norms of `layer` as replicated DTensor weights over tp.

    A q/k norm scales every head by one weight, and under tp a rank holds its own heads only,
    so its local weight gradient sums over those heads alone: the gradient must be summed over
    tp. Declaring the norm's input split over tp (on dim 0: any dim but the normalised last one
    gives the same arithmetic) makes the weight a replicated DTensor, whose gradient DTensor
    reduces over tp, as the sequence-parallel norms' does; the output goes back to the local
    tensor the attention expects.
    """
    names = {n for n, _ in layer.named_modules()}
    return {
        name: SequenceParallel(sequence_dim=0, use_local_output=True)
        for name in HEAD_NORMS
        if name in names
    }


# The per-head norms of a decoder layer's attention (`Family.qk_norm`).
HEAD_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
# Multi-latent attention's down projection of keys and values (a `Family.tp_whole` linear):
# its last ``qk_rope_head_dim`` outputs are the rotary key that every head reads.
LATENT_KV = "self_attn.kv_a_proj_with_mqa"


def _shared_key_styles(
    layer: torch.nn.Module, config: PretrainedConfig
) -> dict[str, ParallelStyle]:
    """`SharedRotaryKey` on `layer`'s `LATENT_KV` projection, when it has one."""
    if LATENT_KV not in {n for n, _ in layer.named_modules()}:
        return {}
    return {LATENT_KV: SharedRotaryKey(config.qk_rope_head_dim)}


class SharedRotaryKey(ParallelStyle):
    """Sum over tp the gradient of the last `width` output features of a replicated linear
    whose output every head reads (multi-latent attention's rotary key).

    The projection stays whole on every tp rank, but the heads reading its output are split:
    each rank's gradient of the rotary key holds its own heads' part only. Its other outputs
    (the latent that ``kv_b_proj`` expands per head) need nothing: a colwise linear's input
    gradient is summed over tp already. The rotary key leaves the projection through a
    Replicate -> Partial-gradient boundary (identity forward, all-reduce backward), as a
    colwise linear's input does; the forward is unchanged. The projection's output is
    ``[B, T, kv_lora_rank + width]``.
    """

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        def hook(_module: torch.nn.Module, _args: object, out: torch.Tensor) -> torch.Tensor:
            latent, key = out.split([out.shape[-1] - self.width, self.width], dim=-1)
            return torch.cat([latent, _summed_in_backward(key, device_mesh)], dim=-1)

        module.register_forward_hook(hook)
        return module


def _summed_in_backward(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """`t` itself in the forward; in the backward its gradient summed over `mesh` (1-D)."""
    whole = DTensor.from_local(t, mesh, (Replicate(),), run_check=False)
    return whole.to_local(grad_placements=(Partial(),))


def _sp_styles(plan: dict[str, str]) -> dict[str, ParallelStyle]:
    whole, shard = (Replicate(),), (Shard(1),)
    styles: dict[str, ParallelStyle] = {}
    for name, kind in plan.items():
        if kind == "norm":
            styles[name] = SequenceParallel()
        elif kind == "scatter":
            styles[name] = PrepareModuleOutput(
                output_layouts=whole, desired_output_layouts=shard, use_local_output=False
            )
        else:  # "gather": HF passes hidden states by keyword to attention, by position to the rest
            styles[name] = PrepareModuleInput(
                input_layouts=shard if name != "self_attn" else None,
                desired_input_layouts=whole if name != "self_attn" else None,
                input_kwarg_layouts={"hidden_states": Shard(1)} if name == "self_attn" else None,
                desired_input_kwarg_layouts={"hidden_states": Replicate()}
                if name == "self_attn"
                else None,
                use_local_output=True,
            )
    return styles


def _sequence_parallel_root(model: Model) -> dict[str, str]:
    """`SEQUENCE_PARALLEL_ROOT`, its ``lm_head`` entry moved to a value model's ``score`` head
    (which, like the lm_head, needs the whole sequence gathered into it)."""
    root = dict(SEQUENCE_PARALLEL_ROOT)
    if model.head == "value":
        root["score"] = root.pop("lm_head")
    return root


def _check_sequence_parallel(model: Model) -> None:
    if not family(model.config).sequence_parallel:
        raise ValueError(
            f"sequence_parallel with a {model.family} model needs the megatron backend (its MLP "
            "does not end in a rowwise linear); use tp without it here"
        )
    if any("lora_" in n for n, _ in model.module.named_parameters()):
        raise ValueError("sequence_parallel with LoRA adapters is not supported; drop one of them")


def all_reduce_dp(t: torch.Tensor, placement: Placement | None) -> torch.Tensor:
    """Sum `t` over the ranks holding other tokens: the data-parallel ranks and the ulysses
    group (a new tensor; `t` itself when there are none)."""
    if placement is None or placement.dp_group is None:
        return t
    t = t.clone()
    dist.all_reduce(t, group=placement.dp_group)
    return t


@torch.no_grad()
def copy_into_shard(dst: torch.Tensor, full: torch.Tensor) -> None:
    """Fill `dst` (a shard, or a whole tensor) with its part of the whole tensor `full`.

    Each rank cuts its own piece from its copy of `full` (no communication).
    """
    if not isinstance(dst, DTensor):
        dst.copy_(full)
        return
    src = distribute_tensor(
        full.to(dst.device), dst.device_mesh, dst.placements, src_data_rank=None
    )
    dst.to_local().copy_(src.to_local())


@torch.no_grad()
def unshard(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole tensors from sharded ones (``full_tensor``, a collective every rank must call)."""
    return {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in params.items()}


def reshard(model: Model) -> None:
    """Free the gathered parameters a forward without backward left behind (FSDP2 keeps the
    root's parameters gathered after forward, expecting a backward to use them)."""
    if isinstance(model.module, FSDPModule):
        model.module.reshard()


def _dp_group(mesh: Mesh) -> dist.ProcessGroup | None:
    if mesh.data_world_size * mesh.ulysses == 1:
        return None
    mine = None
    # new_group is collective over the world: every rank creates every group, in the same order.
    for ranks in mesh.group_ranks(("dp_total", "ulysses")):
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def _mixed_precision(compute_dtype: torch.dtype) -> MixedPrecisionPolicy:
    if compute_dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
