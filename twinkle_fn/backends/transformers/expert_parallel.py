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
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import transformers
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from transformers import PretrainedConfig

from twinkle_fn.mesh import Mesh
from twinkle_fn.models.families import family
from twinkle_fn.sharding import ShardSpec

DISPATCH = "ep_dispatch_experts"
PARAM_SHARD = "grouped_gemm"
_LAYER_KEY = re.compile(r"^(?:.*\.)?layers\.\*\.(?P<sub>.+)$")


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
    """The sharding of parameter `name` (a module name, peft prefixes allowed) under ep: an
    expert tensor splits dim 0 over ``ep`` (whole experts), then FSDP2 splits the local tensor
    over ``edp``; None for a parameter outside the experts."""
    tensors = [sub for sub, style in expert_plan(config).items() if style == PARAM_SHARD]
    for sub in tensors:
        if re.search(rf"(?:^|\.)layers\.\d+\.{re.escape(sub)}$", name):
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
    (transformers' ``apply_expert_parallelism``); returns the experts modules (for FSDP2 over
    ``edp``). `tp_dm` is the (size-1) group of ranks sharing a batch.

    Raises ``ValueError`` when an experts module holds parameters besides its expert tensors
    (e.g. LoRA factors, which the dispatch would not split).
    """
    plan = expert_plan(config)
    dispatched = [sub for sub, style in plan.items() if style == DISPATCH]
    out = []
    for layer in layers:
        names = {n for n, _ in layer.named_modules()}
        params = {n for n, _ in layer.named_parameters()}
        found = [sub for sub in dispatched if sub in names]
        if not found:
            continue  # a dense layer (mlp_only_layers)
        for sub in found:
            extra = sorted(n for n in params if n.startswith(f"{sub}.") and n not in plan)
            if extra:
                raise ValueError(
                    f"mesh ep > 1 splits the expert tensors only, but the experts hold {extra[:3]}; "
                    "train without adapters on the experts, or use ep=1"
                )
        local = {sub: style for sub, style in plan.items() if sub in names or sub in params}
        _transformers_ep()(layer, expert_dm["ep"], tp_dm, local)
        out.extend(layer.get_submodule(sub) for sub in found)
    return out
