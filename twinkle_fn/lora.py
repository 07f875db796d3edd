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

On a mixture-of-experts model the routed experts take adapters too, named as peft 0.17+ names
them on transformers 5 (which fuses each layer's experts into ``mlp.experts.gate_up_proj``
``[experts, 2 * ffn, hidden]`` and ``mlp.experts.down_proj`` ``[experts, hidden, ffn]``):
``target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]``, one rank-``r``
adapter per expert and tensor (peft's ``ParamWrapper``). ``"all-linear"`` on an MoE model adapts
every linear (attention, dense and shared-expert MLPs) and both expert tensors, as upstream
Twinkle does; routers and shared-expert gates are never adapted (`resolve_moe_targets`).

The helpers below the front (`lora_config`, `check_adapters_only`, `resolve_moe_targets`,
`write_adapter`, `write_adapter_into`) are what every backend's LoRA shares.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from peft import LoraConfig
from peft.tuners.tuners_utils import check_target_module_exists
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
ALL_LINEAR = "all-linear"
# transformers 5's fused expert tensors ([experts, out, in]), in the order of megatron's
# linear_fc1 / linear_fc2.
EXPERT_TENSORS = ("gate_up_proj", "down_proj")
_IN_LAYER = re.compile(r"\.layers\.\d+\.(.+)$")


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


@dataclasses.dataclass(frozen=True)
class MoeTargets:
    """The adaptable and the refused parts of an HF MoE model's layers.

    `experts`: full parameter names of the fused expert tensors (`EXPERT_TENSORS`, 3-d), in
    model order; `gates`: full module names of the routers and shared-expert gates (a linear
    whose output is one logit per expert, or one per token), which LoRA never adapts.
    """

    experts: tuple[str, ...]
    gates: tuple[str, ...]

    def layer_paths(self) -> list[str]:
        """The expert tensors' paths inside a decoder layer (``mlp.experts.gate_up_proj``),
        sorted: what `target_parameters` names."""
        return sorted({m[1] for n in self.experts if (m := _IN_LAYER.search(n))})


def moe_targets(hf_module: torch.nn.Module) -> MoeTargets:
    """Where `hf_module` (a transformers 5 causal LM, any device including meta) keeps its
    fused expert tensors and its gates; both empty for a dense model."""
    experts, gates = [], []
    for name, module in hf_module.named_modules():
        owned = dict(module.named_parameters(recurse=False))
        fused = [f"{name}.{p}" for p in EXPERT_TENSORS if p in owned and owned[p].dim() == 3]
        if not fused:
            continue
        experts += fused
        num_experts = owned[EXPERT_TENSORS[0]].shape[0]
        block = name.rpartition(".")[0]
        for child, sub in hf_module.get_submodule(block).named_children():
            weight = getattr(sub, "weight", None)
            is_gate = (
                weight is not None and weight.dim() == 2 and weight.shape[0] in (num_experts, 1)
            )
            if sub is not module and is_gate:
                gates.append(f"{block}.{child}")
    return MoeTargets(tuple(experts), tuple(gates))


def _kept_by_peft(config: LoraConfig, names: set[str], hf_module: torch.nn.Module) -> set[str]:
    """The target module `names` that peft's loader keeps as modules on `hf_module`'s family.

    For some MoE families (GLM-4 MoE, DeepSeek-V3) peft reads ``gate_proj`` / ``up_proj`` /
    ``down_proj`` targets as transformers 4's per-expert linears and turns them into targets of
    the fused experts when it loads an adapter, so an adapter on a dense or shared-expert MLP
    of those names would not load as trained: "all-linear" leaves such names out (the experts
    are adapted through ``target_parameters``). peft's own conversion decides which names.
    """
    try:
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:  # a peft that converts no config keeps every name
        return names
    probe = copy.deepcopy(config)
    probe.target_modules, probe.target_parameters = set(names), None
    convert_peft_config_for_transformers(probe, hf_module, None)
    return names & set(probe.target_modules or ())


def resolve_moe_targets(config: LoraConfig, hf_module: torch.nn.Module) -> LoraConfig:
    """`config` (a private copy, changed in place and returned) with its MoE targets resolved.

    On an MoE model ``target_modules="all-linear"`` becomes the leaf names of every
    ``nn.Linear`` but the output embedding and the gates, and, unless `config` sets them
    (``[]``: no experts) or sets a ``lora_dropout`` (which peft's expert adapters cannot take:
    the experts are then left out, with a warning), ``target_parameters`` both fused expert
    tensors
    (`MoeTargets.layer_paths`). Explicit ``target_parameters`` must each select expert tensors only (peft's matching: the full name
    or a ``.``-suffix of it). Dense models are returned unchanged.

    Raises ``ValueError`` for ``target_parameters`` on a dense model or selecting no expert
    tensor or anything else (a router's weight), target modules that select a router or
    shared-expert gate (a gate decides which experts run; both backends keep it frozen), and
    ``lora_dropout > 0`` with expert targets (peft's expert adapters take no dropout).
    """
    targets = moe_targets(hf_module)
    chosen = list(config.target_parameters or ())
    if not targets.experts:
        if chosen:
            raise ValueError(
                f"LoraConfig.target_parameters={chosen!r} adapts raw parameters, which twinkle "
                "supports only for an MoE model's fused experts; this model is dense: use "
                "target_modules"
            )
        return config
    if isinstance(config.target_modules, str) and config.target_modules.lower() == ALL_LINEAR:
        head = hf_module.get_output_embeddings()
        linears = {
            name.rsplit(".", 1)[-1]
            for name, m in hf_module.named_modules()
            if isinstance(m, torch.nn.Linear) and m is not head and name not in targets.gates
        }
        config.target_modules = _kept_by_peft(config, linears, hf_module)
        if config.target_parameters is None and config.lora_dropout:
            warnings.warn(
                f"LoraConfig(target_modules='all-linear', lora_dropout={config.lora_dropout}) "
                "adapts this MoE model's linears but not its routed experts: peft's expert "
                "adapters (ParamWrapper) take no dropout; set lora_dropout=0 to adapt the "
                "experts too",
                stacklevel=2,
            )
        elif config.target_parameters is None:
            chosen = targets.layer_paths()
    if config.target_modules is not None:
        gated = [g for g in targets.gates if check_target_module_exists(config, g)]
        if gated:
            raise ValueError(
                f"target_modules={config.target_modules!r} selects {gated[:2]}, a router or "
                "shared-expert gate: it decides which experts run, so twinkle keeps it frozen "
                "on both backends; leave it out (e.g. exclude_modules or 'all-linear', which "
                "skips gates)"
            )
    params = [n for n, _ in hf_module.named_parameters()]
    for entry in chosen:
        hits = [n for n in params if n == entry or n.endswith(f".{entry}")]
        others = [n for n in hits if n not in targets.experts]
        if not hits or others:
            what = f"selects {others[:2]}, which are not" if others else "selects none of"
            raise ValueError(
                f"LoraConfig.target_parameters entry {entry!r} {what} the fused expert tensors "
                f"(routers are never adapted); name them as {targets.layer_paths()}"
            )
    if chosen and config.lora_dropout:
        raise ValueError(
            f"LoraConfig.lora_dropout={config.lora_dropout} with expert targets "
            f"{chosen}: peft's expert adapters (ParamWrapper) take no dropout; set "
            "lora_dropout=0 or leave the experts out (target_parameters=[])"
        )
    config.target_parameters = chosen or None
    return config
