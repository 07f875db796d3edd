"""Expert parallelism on the transformers backend, on transformers' own EP.

transformers 5 keeps an MoE layer's routed experts as fused tensors (``gate_up_proj``
``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``) and ships an EP implementation over them
(``transformers.distributed.expert_parallel``): ``MoEParamShard`` splits both tensors on dim 0
over an ep ``DeviceMesh`` (each rank holds ``E / ep`` whole experts and the module's
``num_experts`` becomes that local count), and ``EpDispatchExpertsParallel`` replaces the experts'
forward by an all-to-all dispatch of every (token, expert) pair to the expert's owner and a second
all-to-all back, both differentiable. The model config names which modules take which style
(``base_model_ep_plan``); `expert_plan` reads it, relative to a decoder layer.

Layout (torchtitan's MoE + FSDP2, and `twinkle_fn.mesh`'s expert layout ``etp-ep-edp-pp``): the
ep ranks are carved out of the data ranks, ep fastest, so an expert group holds ``ep``
different data shards; the same experts sit on the ``edp = world / ep`` ranks of an expert
data-parallel group, and FSDP2 shards (and reduces the gradients of) the expert tensors over
that group only, while dense parameters stay data-parallel over every data rank as without ep.
An expert's gradient is the sum over the tokens its ep group sent it (the all-to-all's backward)
summed over its edp group: every data rank's tokens, once, as the core's token normalisation
expects.

LoRA on the experts (peft's ``ParamWrapper`` per expert tensor, ``target_parameters``): the
adapter factors of every expert stay whole on each ep rank and are sharded by FSDP2 over every
data rank like a dense parameter, because peft's ``lora_B`` ``[out, r * experts]`` interleaves
the experts (rank-major) and cannot be cut into whole experts by one dim-0 split. Each rank adds
the update of its own experts only, ``W_e + scaling * B_e @ A_e``, to its local expert tensors
inside the dispatch (`_adapted_experts_forward`), so a factor's gradient is nonzero only in the
rows of the rank's experts and FSDP2's sum over the data ranks adds every expert's tokens once:
the same gradient as one process. Saved adapters and merged exports read the whole factors, as
without ep.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import transformers
from peft.tuners.lora import ParamWrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from transformers import PretrainedConfig

from twinkle_fn.mesh import Mesh
from twinkle_fn.models.families import family
from twinkle_fn.sharding import ShardSpec

DISPATCH = "ep_dispatch_experts"
PARAM_SHARD = "grouped_gemm"
_LAYER_KEY = re.compile(r"^(?:.*\.)?layers\.\*\.(?P<sub>.+)$")
# peft's wrapper levels in a parameter name (``mlp.experts.base_layer.base_layer.gate_up_proj``)
_BASE_LAYER = ".base_layer"


def _transformers_ep() -> Callable[..., Any]:
    """transformers' ``apply_expert_parallelism``, imported on an ep mesh only: recent
    transformers ship it (5.24 does, 5.17 does not), and the backend runs on older ones without
    ep. Raises ``ValueError`` naming the installed version when it lacks it."""
    try:
        from transformers.distributed.expert_parallel import apply_expert_parallelism
    except ImportError as e:
        raise ValueError(
            f"mesh ep > 1 on the transformers backend runs on transformers' expert "
            f"parallelism (transformers.distributed.expert_parallel), which transformers "
            f"{transformers.__version__} lacks; upgrade transformers (5.24 has it), or use "
            "ep=1 or the megatron backend"
        ) from e
    return apply_expert_parallelism


def check_expert_parallel(config: PretrainedConfig, mesh: Mesh) -> None:
    """Refuse expert parallelism this backend does not run, before any compute.

    Raises ``ValueError`` when ``mesh.ep > 1`` and the family has no routed experts or no
    transformers EP plan, ``ep`` does not divide the experts, or the mesh also asks for tp,
    etp, ulysses, cp or pp (not combined with ep here; the megatron backend has them).
    """
    if mesh.ep == 1:
        return
    _transformers_ep()
    name = getattr(config, "model_type", "?")
    if family(config).moe is None:
        raise ValueError(
            f"mesh ep={mesh.ep} splits mixture-of-experts layers, but a {name} model has none; "
            "use ep=1 for a dense family"
        )
    others = {a: getattr(mesh, a) for a in ("tp", "etp", "ulysses", "cp", "pp")}
    mixed = {a: v for a, v in others.items() if v > 1}
    if mixed:
        desc = ", ".join(f"{a}={v}" for a, v in mixed.items())
        raise ValueError(
            f"mesh ep={mesh.ep} with {desc} is not supported on the transformers backend "
            "(ep combines with dp and fsdp here); use the megatron backend or drop "
            f"{', '.join(mixed)}"
        )
    expert_plan(config)
    experts = getattr(config, family(config).moe.num_experts)
    if experts % mesh.ep:
        raise ValueError(
            f"mesh ep={mesh.ep} does not divide the {experts} experts of this {name} model; "
            f"use an ep that divides {experts}"
        )


def expert_plan(config: PretrainedConfig) -> dict[str, str]:
    """The config's transformers EP plan relative to a decoder layer, expert tensors first
    (their sharding sets the local expert count the dispatch reads), e.g.
    ``{"mlp.experts.gate_up_proj": "grouped_gemm", ..., "mlp.experts": "ep_dispatch_experts"}``.

    Raises ``ValueError`` when the config has no plan of whole-expert dispatch and dim-0 tensor
    shards (the only one this backend runs).
    """
    plan = {}
    for key, style in (getattr(config, "base_model_ep_plan", None) or {}).items():
        match = _LAYER_KEY.match(key)
        if match is not None:
            plan[match["sub"]] = style
    if DISPATCH not in plan.values() or set(plan.values()) != {DISPATCH, PARAM_SHARD}:
        name = getattr(config, "model_type", "?")
        raise ValueError(
            f"mesh ep > 1 needs the model's transformers expert-parallel plan of "
            f"'{DISPATCH}' experts with '{PARAM_SHARD}' tensors; {name}'s config has "
            f"{dict(getattr(config, 'base_model_ep_plan', None) or {})}; use ep=1"
        )
    return dict(sorted(plan.items(), key=lambda kv: kv[1] == DISPATCH))


def expert_spec(name: str, config: PretrainedConfig) -> tuple[ShardSpec, ...] | None:
    """The sharding of parameter `name` (a module name, peft prefixes and ``base_layer`` levels
    allowed) under ep: an expert tensor splits dim 0 over ``ep`` (whole experts), then FSDP2
    splits the local tensor over ``edp``; None for a parameter outside the experts (LoRA factors
    of the experts included: they are data-sharded like dense parameters)."""
    tensors = [sub for sub, style in expert_plan(config).items() if style == PARAM_SHARD]
    plain = name.replace(_BASE_LAYER, "")
    for sub in tensors:
        if re.search(rf"(?:^|\.)layers\.\d+\.{re.escape(sub)}$", plain):
            return (ShardSpec(0, "ep"), ShardSpec(0, "edp"))
    return None


def expert_device_mesh(mesh: Mesh) -> DeviceMesh:
    """The torch mesh of the expert layout, dims ``("edp", "ep")`` (ep fastest, as
    `Mesh.expert_rank` with etp = pp = 1)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device, (mesh.edp, mesh.ep), mesh_dim_names=("edp", "ep"))


def shard_experts(
    layers: torch.nn.ModuleList, config: PretrainedConfig, expert_dm: DeviceMesh, tp_dm: DeviceMesh
) -> list[torch.nn.Module]:
    """Split every MoE layer's experts over ``expert_dm["ep"]`` with all-to-all dispatch
    (transformers' ``apply_expert_parallelism``); returns the experts modules holding the expert
    tensors (for FSDP2 over ``edp``). `tp_dm` is the (size-1) group of ranks sharing a batch.

    Experts that peft wrapped with LoRA (``ParamWrapper``) are split at their base module; the
    wrappers' factors stay whole (see the module docstring). Raises ``ValueError`` when an
    experts module holds parameters besides its expert tensors and peft LoRA factors of them.
    """
    plan = expert_plan(config)
    dispatched = [sub for sub, style in plan.items() if style == DISPATCH]
    ep_rank = expert_dm["ep"].get_local_rank()
    out = []
    for layer in layers:
        names = {n for n, _ in layer.named_modules()}
        found = [sub for sub in dispatched if sub in names]
        if not found:
            continue  # a dense layer (mlp_only_layers)
        local = {}
        for sub in found:
            wrappers, base_path = _lora_wrappers(layer, sub)
            base = layer.get_submodule(base_path)
            extra = sorted(n for n, _ in base.named_parameters() if f"{sub}.{n}" not in plan)
            if extra:
                raise ValueError(
                    f"mesh ep > 1 splits the expert tensors (and peft LoRA on them) only, but "
                    f"the experts hold {extra[:3]}; train without other parameters on the "
                    "experts, or use ep=1"
                )
            for tensor, style in plan.items():
                if tensor.startswith(f"{sub}."):
                    local[f"{base_path}{tensor[len(sub) :]}"] = style
            local[base_path] = plan[sub]
            if wrappers:
                _adapt_locally(base, wrappers, ep_rank)
            out.append(base)
        # tensors first: their split sets the local expert count the dispatch reads
        local = dict(sorted(local.items(), key=lambda kv: kv[1] == DISPATCH))
        _transformers_ep()(layer, expert_dm["ep"], tp_dm, local)
    return out


def _lora_wrappers(layer: torch.nn.Module, sub: str) -> tuple[list[ParamWrapper], str]:
    """The peft ``ParamWrapper``s nested at `sub` of `layer` (outermost first) and the path of
    the experts module they wrap (`sub` itself without LoRA)."""
    wrappers, path = [], sub
    module = layer.get_submodule(sub)
    while isinstance(module, ParamWrapper):
        wrappers.append(module)
        module, path = module.base_layer, f"{path}{_BASE_LAYER}"
    return wrappers, path


def _adapt_locally(experts: torch.nn.Module, wrappers: list[ParamWrapper], ep_rank: int) -> None:
    """Route the LoRA update of `wrappers` into `experts` for this rank's experts only: the
    wrappers' own forward (peft's parametrization of the whole expert tensor) becomes a plain
    call of their base, and `experts`' forward (which the dispatch calls with the local expert
    tensors) adds each active adapter's ``scaling * B_e @ A_e`` for the local experts first."""
    for wrapper in wrappers:
        wrapper.forward = wrapper.base_layer.__call__
    experts.forward = _adapted_experts_forward(experts, experts.forward, wrappers, ep_rank)


def _adapted_experts_forward(
    experts: torch.nn.Module,
    forward: Callable[..., torch.Tensor],
    wrappers: list[ParamWrapper],
    ep_rank: int,
) -> Callable[..., torch.Tensor]:
    def adapted(*args: Any, **kwargs: Any) -> torch.Tensor:
        local = experts.num_experts  # the dispatch has split the tensors by now
        rows = slice(ep_rank * local, (ep_rank + 1) * local)
        originals = {}
        for wrapper in wrappers:
            adapters = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
            if wrapper.disable_adapters or wrapper.merged or not adapters:
                continue
            name = wrapper.parameter_name
            weight = experts._parameters[name]  # [local experts, ., .], a local tensor here
            for adapter in adapters:
                # peft's factors of every expert: lhs [experts, ., r], rhs [experts, r, .]
                lhs, rhs, scaling = wrapper.get_delta_factors(adapter)
                weight = torch.baddbmm(weight, lhs[rows], rhs[rows], alpha=scaling)
            originals[name] = experts._parameters[name]
            experts._parameters[name] = weight
        try:
            return forward(*args, **kwargs)
        finally:
            experts._parameters.update(originals)

    return adapted
