"""LoRA: peft adapters on a transformers model, trained by the functional core, exported for peft.

`add_lora` injects peft's LoRA layers into the module with ``peft.inject_adapter_in_model``
rather than wrapping it in a ``PeftModel``: the module stays the transformers causal LM, so its
decoder layers, output embedding (the `FusedLMHead`), config and FSDP2 root are found as before,
and parameter names keep their HF paths (``model.layers.0.self_attn.q_proj.lora_A.default.weight``,
the base weight under ``...q_proj.base_layer.weight``). Only the adapters require grad, so
`twinkle_fn.init` puts only them in the state and the optimizer; the frozen base weights are
sharded with the module but never receive gradients.

`save_adapter` writes what ``PeftModel.save_pretrained`` writes (``adapter_config.json`` and
``adapter_model.safetensors``, keys ``base_model.model.<name without the adapter name>``), so
``peft.PeftModel.from_pretrained(base_model, dir)`` loads it onto a plain HF model.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model
from peft.tuners.tuners_utils import check_target_module_exists
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from twinkle_fn.backends import fsdp
from twinkle_fn.distributed import rank, world_size
from twinkle_fn.models.model import Model
from twinkle_fn.state import TrainState

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The key prefix of a PeftModel's state dict (PeftModel.base_model is a LoraModel whose .model
# is the transformers model): what PeftModel.from_pretrained expects in the file.
PEFT_PREFIX = "base_model.model."

# LoraConfig fields this module refuses unless at their off value: why, and the off value.
_UNSUPPORTED: dict[str, tuple[str, Any]] = {
    "bias": ("trains the base layers' biases", "none"),
    "modules_to_save": ("trains whole copies of modules", None),
    "trainable_token_indices": ("trains rows of the embedding", None),
    "target_parameters": ("adapts raw parameters rather than linear layers", None),
    "use_dora": ("(DoRA) trains a magnitude vector that the sharded backends do not handle", False),
}
# Initialisations that leave the base weights untouched (PiSSA, OLoRA, LoftQ... rewrite them,
# so an exported adapter would no longer apply to the original base model).
_INITS = (True, False, "gaussian")


def add_lora(
    model: Model, config: LoraConfig | dict[str, Any], adapter_name: str = "default"
) -> Model:
    """`model` with peft LoRA adapters injected into its module, in place; base weights frozen.

    `config` is a ``peft.LoraConfig`` or the keyword arguments of one (e.g. ``{"r": 8,
    "lora_alpha": 16, "target_modules": "all-linear"}``; ``"all-linear"`` leaves the lm_head
    out). It is copied, never modified. With the default ``init_lora_weights=True`` every
    ``lora_B`` starts at zero, so the model computes exactly what it did before. Afterwards only
    adapter parameters require grad. Call it before `twinkle_fn.init` / `twinkle_fn.shard` on a
    mesh; under tp the adapter factor on the split side is split like its base layer (see
    `twinkle_fn.models.plans.with_lora`). Returns the model (sharing the module).

    Raises ``ValueError`` for a model that is already sharded or already has an adapter, a
    config that targets the lm_head (it computes the fused loss), one that trains more than
    low-rank adapters or rewrites the base weights (``bias``, ``modules_to_save``,
    ``trainable_token_indices``, ``target_parameters``, ``use_dora``, PiSSA-style
    ``init_lora_weights``), or ``target_modules`` that match no layer (peft's message);
    ``TypeError`` for a config that is neither a ``LoraConfig`` nor a dict of its fields.
    """
    module = model.module
    if model.placement is not None or any(isinstance(p, DTensor) for p in module.parameters()):
        raise ValueError(
            "this model is already sharded; add adapters before tf.init/tf.shard on a mesh "
            "(add_lora on the unsharded model, then tf.init(model, tx, mesh))"
        )
    if getattr(module, "peft_config", None):
        raise ValueError(
            f"this model already has adapters {sorted(module.peft_config)}; add_lora once per model"
        )
    config = _lora_config(config)
    _check_adapters_only(config, _head_name(module))
    inject_adapter_in_model(config, module, adapter_name=adapter_name)
    return dataclasses.replace(model)


def adapter_name_of(module: torch.nn.Module) -> str:
    """The name of the LoRA adapter `add_lora` put into `module`.

    Raises ``ValueError`` when the module has no adapter.
    """
    names = list(getattr(module, "peft_config", None) or ())
    if not names:
        raise ValueError(
            "this model has no LoRA adapter; call twinkle_fn.lora.add_lora(model, config) first"
        )
    return names[0]


def adapter_state_dict(state: TrainState) -> dict[str, torch.Tensor]:
    """The state's adapter weights as whole tensors, keyed as in a peft adapter file.

    Keys are ``base_model.model.<module path>.lora_A.weight`` etc. (the adapter name removed),
    values whole ``[r, in]`` / ``[out, r]`` tensors on the state's device. On several ranks this
    gathers shards: a collective every rank must call. Raises ``ValueError`` when the model has
    no adapter and ``DonatedError`` for a donated state.
    """
    state.check_alive()
    module = state.model.module
    name = adapter_name_of(module)
    full = fsdp.unshard(state.params)
    adapter = get_peft_model_state_dict(
        module, state_dict=full, adapter_name=name, save_embedding_layers=False
    )
    return {PEFT_PREFIX + k: v.contiguous() for k, v in adapter.items()}


def save_adapter(state: TrainState, path: str | os.PathLike[str]) -> Path:
    """Write the state's adapter as a peft adapter directory at `path`; returns the path.

    The directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` for
    ``peft.PeftModel.from_pretrained(base_model, path)``. Every rank must call it (the shards
    are gathered); rank 0 writes into a temporary sibling and renames it into place, replacing
    an older directory only once the new one is complete; all ranks return after the rename.
    Raises ``ValueError`` when the model has no adapter, and ``RuntimeError`` on every rank
    when rank 0 fails to write (its error is in the message).
    """
    path = Path(path)
    weights = adapter_state_dict(state)
    error = None
    if rank() == 0:
        try:
            _write_adapter(state.model.module, weights, path)
        except Exception as e:  # reported to every rank below, so none waits forever
            error = f"{type(e).__name__}: {e}"
    if world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise RuntimeError(f"rank 0 could not write the adapter to {path}: {error}")
    return path


def _lora_config(config: LoraConfig | dict[str, Any]) -> LoraConfig:
    """A private copy of `config` (peft resolves ``target_modules`` into the config it gets)."""
    if isinstance(config, LoraConfig):
        return copy.deepcopy(config)
    if isinstance(config, dict):
        try:
            return LoraConfig(**config)
        except TypeError as e:
            raise TypeError(f"config dict is not LoraConfig fields ({e})") from e
    raise TypeError(f"config must be a LoraConfig or a dict of its fields, not {type(config)}")


def _check_adapters_only(config: LoraConfig, head: str) -> None:
    for field, (why, off) in _UNSUPPORTED.items():
        value = getattr(config, field, off)
        if value and value != off:
            raise ValueError(
                f"LoraConfig.{field}={value!r} {why}, which twinkle's LoRA does not support; "
                f"set {field}={off!r}"
            )
    if config.init_lora_weights not in _INITS:
        raise ValueError(
            f"LoraConfig.init_lora_weights={config.init_lora_weights!r} rewrites the base "
            "weights, so the adapter would not apply to the original model; use True (B = 0) "
            "or 'gaussian'"
        )
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


def _write_adapter(module: torch.nn.Module, weights: dict[str, torch.Tensor], path: Path) -> None:
    """Write the adapter files into a temporary sibling of `path`, then move it into place."""
    config = copy.deepcopy(module.peft_config[adapter_name_of(module)])
    # What PeftModel.save_pretrained records, so from_pretrained builds a PeftModelForCausalLM.
    config.task_type = config.task_type or "CAUSAL_LM"
    config.inference_mode = True
    config.base_model_name_or_path = config.base_model_name_or_path or (
        getattr(module.config, "_name_or_path", None) or None
    )
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        config.save_pretrained(tmp)
        cpu = {k: v.detach().cpu() for k, v in weights.items()}
        save_file(cpu, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
        _replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace_dir(src: Path, dst: Path) -> None:
    old = None
    if dst.exists():
        old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
