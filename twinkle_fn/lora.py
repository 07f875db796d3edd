"""LoRA adapters on either backend: one signature, exported as peft adapter directories.

`add_lora` gives a `Model` a peft LoRA adapter before ``tf.init``; only the adapter's weights
then require grad, so the train state and the optimizer hold the adapter alone. How the adapter
is built is the backend's business (peft's own layers injected into the transformers module on
the transformers backend; parallel LoRA linears on megatron's ``GPTModel``); what comes out is
the same: `save_adapter` writes what ``PeftModel.save_pretrained`` writes (``adapter_config.json``
and ``adapter_model.safetensors``, keys ``base_model.model.<HF module path>.lora_A.weight``), so
``peft.PeftModel.from_pretrained(base_model, dir)`` loads it onto a plain HF model.

A module may hold several named adapters where the backend supports it (the transformers
backend does; megatron trains one per model): one is active at a time, and `set_adapter`
selects the one a following ``tf.init`` builds its state over.

The helpers below the front (`lora_config`, `check_adapters_only`, `write_adapter`, `write_adapter_into`) are what
every backend's LoRA shares.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from peft import LoraConfig
from safetensors.torch import save_file

from twinkle_fn import backends
from twinkle_fn.checkpoint import staged
from twinkle_fn.distributed import rank, world_size
from twinkle_fn.models.model import Model
from twinkle_fn.state import TrainState

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The key prefix of a PeftModel's state dict (PeftModel.base_model is a LoraModel whose .model
# is the transformers model): what PeftModel.from_pretrained expects in the file.
PEFT_PREFIX = "base_model.model."
# Initialisations that leave the base weights untouched (PiSSA, OLoRA, LoftQ... rewrite them,
# so an exported adapter would no longer apply to the original base model).
_INITS = (True, False, "gaussian")


def add_lora(
    model: Model, config: LoraConfig | Mapping[str, Any], adapter_name: str = "default"
) -> Model:
    """`model` with LoRA adapter `adapter_name` (a ``peft.LoraConfig`` or its fields as a dict),
    base weights frozen; call it before ``tf.init``.

    `config` is copied, never modified. With the default ``init_lora_weights=True`` every
    ``lora_B`` starts at zero, so the model computes exactly what it did before. The new adapter
    becomes the active one. Returns the model. Raises ``ValueError`` for a model already placed
    on a mesh, a bad or taken `adapter_name`, a config that trains more than low-rank adapters
    or targets no layer (each backend names what it refuses), ``TypeError`` for a config that is
    neither a ``LoraConfig`` nor a dict of its fields.
    """
    return backends.get(model.backend).add_lora(model, config, adapter_name)


def adapter_names(model: Model | torch.nn.Module) -> list[str]:
    """The names of the adapters `model` holds, in the order added (a bare module: the peft
    adapters injected into it)."""
    if isinstance(model, Model):
        return backends.get(model.backend).adapter_names(model)
    return list(getattr(model, "peft_config", None) or ())


def set_adapter(model: Model, adapter_name: str) -> None:
    """Make `adapter_name` the active adapter of `model`, in place: the forward adds only its
    update and only its weights require grad, so ``tf.init`` builds a state over exactly them.

    Raises ``ValueError`` for an adapter the model lacks, naming those it has.
    """
    backends.get(model.backend).set_adapter(model, adapter_name)


def use_adapter(state: TrainState) -> None:
    """Before computing with `state`: make the adapter(s) whose weights it trains the active
    ones (nothing when the model holds one adapter or none)."""
    backends.get(state.model.backend).use_adapter(state)


def adapter_state_dict(state: TrainState) -> dict[str, torch.Tensor]:
    """The weights of the adapter `state` trains, as whole tensors keyed as in a peft adapter
    file (``base_model.model.<HF module path>.lora_A.weight``; the adapter name removed).

    On several ranks this gathers shards: a collective every rank must call. Raises
    ``ValueError`` when the state trains no adapter (or several), ``DonatedError`` for a
    donated state.
    """
    state.check_alive()
    return backends.get(state.model.backend).adapter_state_dict(state)


def save_adapter(state: TrainState, path: str | os.PathLike[str]) -> Path:
    """Write the adapter `state` trains as a peft adapter directory at `path`; returns the path.

    The directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` for
    ``peft.PeftModel.from_pretrained(base_model, path)``. Every rank must call it (the shards
    are gathered); rank 0 writes into a temporary sibling and switches it into place in one
    atomic step (`twinkle_fn.checkpoint.staged`). Raises ``ValueError`` as
    `adapter_state_dict`, and ``RuntimeError`` on every rank when rank 0 fails to write (its
    error is in the message).
    """
    with staged(path) as directory:
        save_adapter_into(state, directory)
    return Path(path)


def save_adapter_into(state: TrainState, directory: str | os.PathLike[str]) -> Path:
    """Write the adapter files of `save_adapter` into the existing `directory` with no switch:
    for a save made of several parts inside one `twinkle_fn.checkpoint.staged` block. Every
    rank must call it. Raises as `save_adapter`."""
    state.check_alive()
    backend = backends.get(state.model.backend)
    config = backend.adapter_config(state)
    weights = backend.adapter_state_dict(state)
    return write_adapter_into(config, state.model.config, weights, directory)


def lora_config(config: LoraConfig | Mapping[str, Any]) -> LoraConfig:
    """A private copy of `config` (peft resolves ``target_modules`` into the config it gets).

    Raises ``TypeError`` for something that is neither a ``LoraConfig`` nor a mapping of its
    fields.
    """
    if isinstance(config, LoraConfig):
        return copy.deepcopy(config)
    if isinstance(config, Mapping):
        try:
            return LoraConfig(**config)
        except TypeError as e:
            raise TypeError(f"config mapping is not LoraConfig fields ({e})") from e
    raise TypeError(f"config must be a LoraConfig or a dict of its fields, not {type(config)}")


def check_adapters_only(
    config: LoraConfig, unsupported: Mapping[str, tuple[str, Any]], who: str
) -> None:
    """Refuse a `config` that would train more than low-rank adapters of untouched weights.

    `unsupported`: ``LoraConfig`` field -> (what it does, its off value); `who` names the LoRA
    implementation in the message. Raises ``ValueError`` naming the field and its off value,
    or an initialisation that rewrites the base weights (PiSSA, OLoRA, LoftQ...).
    """
    for field, (why, off) in unsupported.items():
        value = getattr(config, field, off)
        if value and value != off:
            raise ValueError(
                f"LoraConfig.{field}={value!r} {why}, which {who} does not support; "
                f"set {field}={off!r}"
            )
    if config.init_lora_weights not in _INITS:
        raise ValueError(
            f"LoraConfig.init_lora_weights={config.init_lora_weights!r} rewrites the base "
            "weights, so the adapter would not apply to the original model; use True (B = 0), "
            "'gaussian' or False"
        )


def write_adapter(
    config: LoraConfig,
    hf_config: Any,
    weights: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
) -> Path:
    """Write a peft adapter directory at `path` from rank 0: `config` as peft records it (task
    ``CAUSAL_LM``, base model from `hf_config`) and `weights` (peft file keys); returns the path.

    Every rank must call it. Rank 0 writes a temporary sibling and switches it into place in one
    atomic step (`twinkle_fn.checkpoint.staged`), so an older directory stays until the new one
    is complete. Raises ``RuntimeError`` on every rank when rank 0 fails to write (its error is
    in the message).
    """
    with staged(path) as directory:
        write_adapter_into(config, hf_config, weights, directory)
    return Path(path)


def write_adapter_into(
    config: LoraConfig,
    hf_config: Any,
    weights: Mapping[str, torch.Tensor],
    directory: str | os.PathLike[str],
) -> Path:
    """`write_adapter`'s files written into the existing `directory` with no switch. Every rank
    must call it; returns the directory. Raises as `write_adapter`."""
    directory = Path(directory)
    error = None
    if rank() == 0:
        try:
            _write_adapter(config, hf_config, weights, directory)
        except Exception as e:  # reported to every rank below, so none waits forever
            error = f"{type(e).__name__}: {e}"
    if world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise RuntimeError(f"rank 0 could not write the adapter to {directory}: {error}")
    return directory


def _write_adapter(
    config: LoraConfig, hf_config: Any, weights: Mapping[str, torch.Tensor], directory: Path
) -> None:
    config = copy.deepcopy(config)
    # What PeftModel.save_pretrained records, so from_pretrained builds a PeftModelForCausalLM.
    config.task_type = config.task_type or "CAUSAL_LM"
    config.inference_mode = True
    config.base_model_name_or_path = config.base_model_name_or_path or (
        getattr(hf_config, "_name_or_path", None) or None
    )
    config.save_pretrained(directory)
    cpu = {k: v.detach().cpu() for k, v in weights.items()}
    save_file(cpu, directory / ADAPTER_WEIGHTS, metadata={"format": "pt"})
