"""LoRA on the transformers backend: peft's own layers injected into the HF module.

`add_lora` injects peft's LoRA layers into the module with ``peft.inject_adapter_in_model``
rather than wrapping it in a ``PeftModel``: the module stays the transformers causal LM, so its
decoder layers, output embedding (the `FusedLMHead`), config and FSDP2 root are found as before,
and parameter names keep their HF paths (``model.layers.0.self_attn.q_proj.lora_A.default.weight``,
the base weight under ``...q_proj.base_layer.weight``). Only the adapters require grad, so
`twinkle_fn.init` puts only them in the state and the optimizer; the frozen base weights are
sharded with the module but never receive gradients. peft's plain ``Linear`` layers become
`twinkle_fn.backends.transformers.lora_layer.FactorScaledLinear` (the scale applied to ``A``).

A module may hold several named adapters (``add_lora`` once per name), as peft's multi-adapter
models do: one is *active* at a time, meaning the forward adds only its low-rank update and only
its weights require grad (peft's ``set_adapter`` semantics). `set_adapter` selects one, so that
``twinkle_fn.init`` builds a state over that adapter alone; each adapter then has its own state,
optimizer state and step. `use_adapter` (called by `twinkle_fn.fwd_bwd`, `evaluate` and `shard`)
activates the adapter whose weights a state holds before computing with it.

The backend-independent front is `twinkle_fn.lora`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model
from peft.tuners.tuners_utils import BaseTunerLayer, check_target_module_exists
from torch.distributed.tensor import DTensor

from twinkle_fn.backends.transformers import fsdp
from twinkle_fn.backends.transformers.lora_layer import scale_factors
from twinkle_fn.lora import PEFT_PREFIX, check_adapters_only, lora_config, resolve_moe_targets
from twinkle_fn.models.model import Model
from twinkle_fn.state import TrainState

# LoraConfig fields this module refuses unless at their off value: why, and the off value.
_UNSUPPORTED: dict[str, tuple[str, Any]] = {
    "bias": ("trains the base layers' biases", "none"),
    "modules_to_save": ("trains whole copies of modules", None),
    "trainable_token_indices": ("trains rows of the embedding", None),
    "use_dora": ("(DoRA) trains a magnitude vector that the sharded backends do not handle", False),
}
# The adapter name inside a LoRA weight's name: ``<layer>.lora_A.<adapter>.weight`` (linear),
# ``<layer>.lora_embedding_B.<adapter>`` (embedding).
_ADAPTER_OF_PARAM = re.compile(r"\.lora_(?:embedding_)?[AB]\.([^.]+)(?:\.|$)")


def add_lora(
    model: Model, config: LoraConfig | Mapping[str, Any], adapter_name: str = "default"
) -> Model:
    """`model` with peft LoRA adapter `adapter_name` injected into its module, in place; base
    weights frozen.

    `config` is a ``peft.LoraConfig`` or the keyword arguments of one (e.g. ``{"r": 8,
    "lora_alpha": 16, "target_modules": "all-linear"}``; ``"all-linear"`` leaves the lm_head
    out; on an MoE model it adds the routed experts, see `twinkle_fn.lora.resolve_moe_targets`).
    It is copied, never modified. With the default ``init_lora_weights=True`` every
    ``lora_B`` starts at zero, so the model computes exactly what it did before. A module may
    hold several adapters under different names (each with its own config); the new one becomes
    the active one (see `set_adapter`), so afterwards only its parameters require grad. Its
    ``lora_A`` init draws from torch's global generator (seed it first for a reproducible
    adapter). Call it before `twinkle_fn.init` / `twinkle_fn.shard` on a mesh; under tp the
    adapter factor on the split side is split like its base layer (see
    `twinkle_fn.backends.transformers.plans.with_lora`). Returns the model (sharing the module).

    Raises ``ValueError`` for a value model (its head would stay frozen), a model that is already
    sharded, an `adapter_name` that is empty,
    holds a ``.`` or is already taken (naming the adapters there), a config that targets the
    lm_head (it computes the fused loss), one that trains more than low-rank adapters or
    rewrites the base weights (``bias``, ``modules_to_save``, ``trainable_token_indices``,
    ``use_dora``, PiSSA-style ``init_lora_weights``), MoE targets that
    `twinkle_fn.lora.resolve_moe_targets` refuses (a router, ``target_parameters`` other than
    the fused experts), or
    ``target_modules`` that match no layer (peft's message); ``TypeError`` for a config that is
    neither a ``LoraConfig`` nor a dict of its fields.
    """
    module = model.module
    if model.head == "value":
        raise ValueError(
            "add_lora on a value model would freeze its freshly initialised score head (twinkle's "
            "LoRA trains adapters only); train the critic in full, without add_lora"
        )
    if model.placement is not None or any(isinstance(p, DTensor) for p in module.parameters()):
        raise ValueError(
            "this model is already sharded; add adapters before tf.init/tf.shard on a mesh "
            "(add_lora on the unsharded model, then tf.init(model, tx, mesh))"
        )
    if not isinstance(adapter_name, str) or not adapter_name or "." in adapter_name:
        raise ValueError(f"adapter_name must be a non-empty str without '.', got {adapter_name!r}")
    names = adapter_names(module)
    if adapter_name in names:
        raise ValueError(
            f"this model already has adapter {adapter_name!r} (adapters: {names}); add another "
            "adapter under a new name"
        )
    config = resolve_moe_targets(lora_config(config), module)
    check_adapters_only(config, _UNSUPPORTED, "twinkle's LoRA")
    _check_head(config, _head_name(module))
    try:
        with warnings.catch_warnings():
            # peft warns whenever a second adapter joins a module: that is the point here.
            warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
            inject_adapter_in_model(config, module, adapter_name=adapter_name)
        scale_factors(module)
    except BaseException:
        # peft registers the config before matching the targets; a failed add leaves no trace.
        if names:
            module.peft_config.pop(adapter_name, None)
        elif hasattr(module, "peft_config"):
            del module.peft_config
        raise
    set_adapter(module, adapter_name)
    return dataclasses.replace(model)


def store_frozen_in(
    module: torch.nn.Module, dtype: torch.dtype, master_weights: bool = True
) -> None:
    """Store `module`'s frozen weight matrices in `dtype` (the compute dtype), in place; without
    `master_weights`, every floating parameter.

    A parameter that never trains needs no float32 master copy: under autocast its matmul reads
    it in the compute dtype anyway, so float32 storage only doubles its memory and casts it again
    in every forward. A *frozen weight matrix* is a floating parameter of two or more dims with
    ``requires_grad=False`` that is not a LoRA adapter factor (an inactive adapter is frozen only
    until `set_adapter` selects it, and trains from float32 then). Vectors (norm weights, biases)
    stay as they are: they are tiny, and torch multiplies a norm's weight outside autocast, in
    the weight's own dtype, so casting it would change the forward. Casting a matrix does not:
    autocast rounds a float32 weight to `dtype` exactly as ``Tensor.to`` does, so the forward is
    bit-identical. ``master_weights=False`` (the model option of that name) stores the trained
    parameters in `dtype` too, for an optimizer that keeps its own precision
    (`twinkle_fn.optim.adamw_bf16`). Nothing happens for a float32 `dtype`. The parameter objects
    stay the same (ties such as a tied lm_head / embedding survive). Call it before the module
    is sharded.
    """
    if dtype == torch.float32:
        return
    for name, p in module.named_parameters():
        if not p.is_floating_point() or p.dtype == dtype:
            continue
        if master_weights and (p.requires_grad or p.ndim < 2 or _ADAPTER_OF_PARAM.search(name)):
            continue
        p.data = p.data.to(dtype)


def adapter_names(module: torch.nn.Module) -> list[str]:
    """The names of the LoRA adapters `add_lora` put into `module`, in the order added."""
    return list(getattr(module, "peft_config", None) or ())


def set_adapter(model: Model | torch.nn.Module, adapter_name: str) -> None:
    """Make `adapter_name` the active adapter of `model`'s module, in place.

    The forward then adds only this adapter's low-rank update (the others are skipped, not
    computed), and only its weights require grad, so `twinkle_fn.init` builds a state over
    exactly them. Raises ``ValueError`` for an adapter the module lacks, naming those it has.
    """
    module = model.module if isinstance(model, Model) else model
    names = adapter_names(module)
    if adapter_name not in names:
        have = f"adapters {names}" if names else "no LoRA adapter (add one with add_lora)"
        raise ValueError(f"adapter {adapter_name!r} does not exist; this model has {have}")
    _activate(module, [adapter_name])


def adapters_of(params: Iterable[str]) -> list[str]:
    """The names of the adapters whose weights `params` (parameter names) include, sorted."""
    return sorted({m[1] for n in params if (m := _ADAPTER_OF_PARAM.search(n))})


def use_adapter(state: TrainState) -> None:
    """Before computing with `state`: make the adapter(s) whose weights it trains the active
    ones, when its module holds several adapters (else nothing: one adapter is always active).
    """
    module = state.model.module
    if len(adapter_names(module)) < 2:
        return
    mine = adapters_of(state.params)
    if mine:
        _activate(module, mine)


def _activate(module: torch.nn.Module, names: list[str]) -> None:
    for layer in module.modules():
        if isinstance(layer, BaseTunerLayer):
            layer.set_adapter(names)


def _adapter_of_state(state: TrainState) -> str:
    """The one adapter whose weights `state` trains. Raises ``ValueError`` when the model has
    no adapter, or the state holds none or several."""
    names = adapter_names(state.model.module)
    if not names:
        raise ValueError(
            "this model has no LoRA adapter; call twinkle_fn.backends.transformers.lora.add_lora(model, config) first"
        )
    mine = adapters_of(state.params)
    if len(mine) != 1:
        raise ValueError(
            f"this state trains the weights of adapters {mine} (model adapters: {names}); "
            "build the state over one adapter: twinkle_fn.backends.transformers.lora.set_adapter(model, name), then "
            "twinkle_fn.init"
        )
    return mine[0]


def adapter_state_dict(state: TrainState) -> dict[str, torch.Tensor]:
    """The weights of the adapter the state trains, as whole tensors, keyed as in a peft
    adapter file.

    Keys are ``base_model.model.<module path>.lora_A.weight`` etc. (the adapter name removed),
    values whole ``[r, in]`` / ``[out, r]`` tensors on the state's device. On several ranks this
    gathers shards: a collective every rank must call. Raises ``ValueError`` when the model has
    no adapter or the state trains none or several, and ``DonatedError`` for a donated state.
    """
    state.check_alive()
    module = state.model.module
    name = _adapter_of_state(state)
    full = fsdp.unshard(state.params)
    adapter = get_peft_model_state_dict(
        module, state_dict=full, adapter_name=name, save_embedding_layers=False
    )
    return {PEFT_PREFIX + k: v.contiguous() for k, v in adapter.items()}


def _check_head(config: LoraConfig, head: str) -> None:
    # target_modules=None means peft's per-family defaults, which never include the lm_head.
    if config.target_modules is not None and check_target_module_exists(config, head):
        raise ValueError(
            f"target_modules={config.target_modules!r} matches the lm_head {head!r}, which "
            "computes the fused loss and must stay a plain linear layer; leave it out "
            "(e.g. target_modules='all-linear', which excludes it)"
        )


def _head_name(module: torch.nn.Module) -> str:
    head = module.get_output_embeddings()
    return next(n for n, m in module.named_modules() if m is head)


def adapter_config(state: TrainState) -> LoraConfig:
    """The peft config of the adapter `state` trains. Raises ``ValueError`` as
    `adapter_state_dict` does."""
    return state.model.module.peft_config[_adapter_of_state(state)]


@contextlib.contextmanager
def adapters_off(module: torch.nn.Module) -> Iterator[None]:
    """Within the block `module` computes with its base weights alone (every adapter skipped)."""
    layers = [m for m in module.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
