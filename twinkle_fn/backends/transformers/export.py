"""Weights out of a transformers-backend state, parameter by parameter (`twinkle_fn.export`).

Each parameter of the HF module is gathered alone (``DTensor.full_tensor()``: an all-gather over
the FSDP2 / tp mesh, which every rank of it calls in the same order), cast, and put into the
current bucket, so a rank holds at most one bucket and the parameter being gathered. Names and
layouts are the HF checkpoint's, as the megatron backend's and as a rollout engine loads them:
transformers 5 fuses some checkpoint tensors in memory (qwen3_moe's experts into one
``experts.gate_up_proj``), so each parameter is reverted alone with transformers'
``revert_weight_conversion`` (per-expert ``experts.<i>.gate_proj.weight`` ...). A tied output
embedding appears once, as the input embedding. With LoRA (peft layers injected, `twinkle_fn.backends.transformers.lora`) the base
weights sit under ``<layer>.base_layer.weight`` and the factors under
``<layer>.lora_A.<adapter>.weight``: ``"separate"`` yields the state's adapter with peft's file
names, ``"merged"`` yields ``<layer>.weight = W + scaling * B @ A`` (computed in float32) and
no factor.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from peft.tuners.lora import LoraLayer, ParamWrapper
from torch.distributed.tensor import DTensor
from transformers.core_model_loading import revert_weight_conversion

from twinkle_fn.backends.buckets import Bucket, buckets, persistent_buffers
from twinkle_fn.backends.transformers import fsdp
from twinkle_fn.backends.transformers.fp8_linears import dense_state
from twinkle_fn.backends.transformers.lora import _ADAPTER_OF_PARAM, _adapter_of_state
from twinkle_fn.backends.transformers.lora import adapter_names as _adapter_names
from twinkle_fn.lora import PEFT_PREFIX
from twinkle_fn.state import TrainState

_BASE = ".base_layer."


def export_weights(
    state: TrainState, dtype: torch.dtype, bucket_bytes: int, lora: str
) -> Iterator[Bucket]:
    """See `twinkle_fn.export.export_weights`. Raises ``ValueError`` (eagerly) when the state
    trains no adapter or several on a module holding adapters, and (while streaming, with
    ``lora="merged"``) for an adapted layer that is neither a linear nor an embedding."""
    module = state.model.module
    adapter = _adapter_of_state(state) if _adapter_names(module) else None
    # A forward without backward leaves the root's parameters gathered; export reads shards.
    fsdp.reshard(state.model)
    if adapter is None:
        named = _checkpoint_layout(module, _plain(module, dtype))
    elif lora == "separate":
        named = _adapter(module, adapter, dtype)
    else:
        named = _checkpoint_layout(module, _merged(module, adapter, dtype))
    return buckets(named, bucket_bytes)


def _checkpoint_layout(
    module: torch.nn.Module, named: Iterator[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """`named`'s in-memory weights in the HF checkpoint's names and layout, one at a time:
    transformers' conversions fuse several checkpoint tensors into one parameter, so one
    parameter reverts alone into its checkpoint tensors."""
    for name, tensor in named:
        yield from revert_weight_conversion(module, {name: tensor}).items()


def whole(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`param` whole, in `dtype` (a sharded `DTensor` is cast before its all-gather, which then
    moves `dtype`'s bytes: a collective over its mesh)."""
    t = param.detach()
    if isinstance(t, DTensor):
        return t.to(dtype).full_tensor()
    return t.to(dtype)


def _plain(module: torch.nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    for name, param in dense_state(module, module.named_parameters()):
        yield name, whole(param, dtype)
    yield from _buffers(module, dtype)


def _buffers(module: torch.nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The persistent buffers of `module` (`persistent_buffers`: GLM-4 MoE's and DeepSeek-V3's
    router ``e_score_correction_bias``), which a rollout engine loads too."""
    for name, buffer in persistent_buffers(module).items():
        yield name, whole(buffer, dtype)


def _adapter(
    module: torch.nn.Module, adapter: str, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, param in module.named_parameters():
        found = _ADAPTER_OF_PARAM.search(name)
        if found and found[1] == adapter:
            # peft's file names drop the adapter: ``q_proj.lora_A.default.weight`` ->
            # ``q_proj.lora_A.weight``, ``embed.lora_embedding_A.default`` -> ``...lora_embedding_A``.
            plain = name[: found.start(1) - 1] + name[found.end(1) :]
            yield PEFT_PREFIX + plain, whole(param, dtype)


def _merged(
    module: torch.nn.Module, adapter: str, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    layers = {n: m for n, m in module.named_modules() if isinstance(m, LoraLayer)}
    for name, param in dense_state(module, module.named_parameters()):
        if _ADAPTER_OF_PARAM.search(name):
            continue
        if _BASE not in name:
            yield name, whole(param, dtype)
            continue
        plain = name.replace(_BASE, ".")
        while _BASE in plain:  # nested wrappers (peft's ParamWrapper per expert tensor)
            plain = plain.replace(_BASE, ".")
        leaf = plain.rsplit(".", 1)[1]
        layer = _adapting(layers, name, leaf)
        if layer is None:
            yield plain, whole(param, dtype)
            continue
        weight = whole(param, torch.float32)
        delta = _delta(layer, plain, adapter)
        yield plain, (weight if delta is None else weight + delta).to(dtype)
    yield from _buffers(module, dtype)


def _adapting(layers: dict[str, LoraLayer], name: str, leaf: str) -> LoraLayer | None:
    """The LoRA layer that adapts parameter `name` (its last component `leaf`): a linear's
    ``<path>.base_layer.weight``, or the ``ParamWrapper`` at one of the ``base_layer`` levels of
    `name` whose ``parameter_name`` is `leaf`."""
    path = name
    while _BASE in path + ".":
        path = path.rsplit(".base_layer", 1)[0]
        layer = layers.get(path)
        if isinstance(layer, ParamWrapper):
            if layer.parameter_name == leaf:
                return layer
        elif layer is not None and name == f"{path}.base_layer.weight":
            return layer
    return None


def _delta(layer: LoraLayer, path: str, adapter: str) -> torch.Tensor | None:
    """The adapter's whole update of `layer`'s weight in float32 (None where it has none)."""
    scaling = layer.scaling.get(adapter)
    if isinstance(layer, ParamWrapper) and adapter in layer.lora_A:
        return scaling * _expert_delta(layer, adapter)
    if adapter in layer.lora_A:
        a = whole(layer.lora_A[adapter].weight, torch.float32)
        b = whole(layer.lora_B[adapter].weight, torch.float32)
        delta = b @ a
        return scaling * (delta.T if getattr(layer, "fan_in_fan_out", False) else delta)
    if adapter in layer.lora_embedding_A:
        a = whole(layer.lora_embedding_A[adapter], torch.float32)
        b = whole(layer.lora_embedding_B[adapter], torch.float32)
        return scaling * (b @ a).T
    if scaling is None:
        return None
    raise ValueError(
        f"cannot merge adapter {adapter!r} into {path!r} ({type(layer).__name__}): only linear "
        "and embedding LoRA layers merge; export with lora='separate'"
    )


def _expert_delta(layer: ParamWrapper, adapter: str) -> torch.Tensor:
    """``B_e @ A_e`` of every expert in the layout of the wrapped parameter (float32, whole):
    peft's ``ParamWrapper.get_delta_weight`` on the gathered factors (``lora_A``
    ``[r * experts, in]`` expert-major, ``lora_B`` ``[out, r * experts]`` rank-major)."""
    experts = layer.num_experts
    a = whole(layer.lora_A[adapter].weight, torch.float32)
    b = whole(layer.lora_B[adapter].weight, torch.float32)
    if experts == 1:
        return b @ a
    a = a.reshape(experts, -1, a.shape[-1])  # [experts, r, in]
    b = b.reshape(b.shape[0], -1, experts)  # [out, r, experts]
    # the wrapped tensor is [experts, out, in] when peft swapped its in/out features
    pattern = (
        "o r e, e r i -> e o i" if layer._did_swap_in_out_features else "o r e, e r i -> e i o"
    )
    return torch.einsum(pattern, b, a)
