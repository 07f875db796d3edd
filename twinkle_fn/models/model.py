"""`Model`: the static description of what a train state computes with.

A `Model` pairs a module skeleton (a transformers causal LM, or for a critic the same body under a
scalar value head) with its family, the backend that runs it and the dtype its matmuls run in. It
is static metadata of a `TrainState`: the trainable tensors live in the state, the module only
provides the computation.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.core_model_loading import revert_weight_conversion

from twinkle_fn import backends
from twinkle_fn.models.families import family_of
from twinkle_fn.tensor_specs import (
    TensorSpec,
    check_finite,
    check_specs,
    module_specs,
    safetensors_specs,
)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HEADS = ("lm", "value")
"""What a model's last layer computes: ``"lm"`` the vocabulary's logits (a causal LM), ``"value"``
one scalar per token (a critic)."""
# A critic's head reads the body's last hidden state as it is: no dropout, as verl's critic.
_VALUE_HEAD = {"num_labels": 1, "classifier_dropout": 0.0}


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
    """A causal LM ready to be trained by a backend.

    ``module``: the transformers model (parameters in ``param_dtype``, usually float32 master
    weights). ``family``: its ``model_type``. ``backend``: ``"transformers"`` (FSDP2/DTensor over
    the module, which on one process runs the module as is; ``"fsdp"`` is its older name) or ``"megatron"`` (which builds megatron-core's
    ``GPTModel`` from the module's config and weights when a state is initialised).
    ``compute_dtype``: the autocast dtype of the forward pass (``torch.float32`` means no
    autocast). ``placement``: None on one process, else the backend's description of the mesh
    the module is sharded over. ``options``: backend settings (the megatron backend's are listed
    in `twinkle_fn.backends.megatron.backend`). ``weights_dir``: a local HF checkpoint directory that
    the megatron backend reads each rank's slices from; the module is then a skeleton on the
    meta device. ``head``: one of `HEADS`; a ``"value"`` model's module is transformers'
    ``<Family>ForTokenClassification`` with one label (the causal LM's body ``model.*`` and a
    ``score`` linear ``[hidden] -> 1`` with a bias), whose per-token outputs are values; the
    megatron backend builds it as ``GPTModel`` with a replicated value head
    (`twinkle_fn.backends.megatron.model.ValueHead`), its module lending config and weights
    (from a directory: a skeleton on the meta device but for an initialised head).
    """

    module: torch.nn.Module
    family: str
    backend: str = "transformers"
    compute_dtype: torch.dtype = torch.float32
    placement: Any = None  # set by a multi-rank backend: where the module's shards live
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    weights_dir: Path | None = None
    head: str = "lm"

    @property
    def config(self) -> PretrainedConfig:
        """The HF config of the module."""
        return self.module.config

    @property
    def device(self) -> torch.device:
        """The device of the module's first parameter."""
        return next(self.module.parameters()).device


def from_hf_config(
    config: PretrainedConfig | dict[str, Any],
    *,
    backend: str = "transformers",
    precision: str = "fp32",
    device: str | torch.device | None = None,
    seed: int | None = None,
    activation_checkpointing: bool = False,
    options: Mapping[str, Any] | None = None,
    head: str = "lm",
) -> Model:
    """Build a randomly initialised causal LM of a supported family from an HF config.

    `config` is a ``PretrainedConfig`` or a dict with a ``model_type`` key. `precision` is the
    compute dtype: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (parameters stay float32 master weights).
    `seed` seeds the initialisation. `activation_checkpointing` recomputes each decoder layer's
    activations in backward instead of storing them. `options` are backend settings (see
    `Model`). `head` ``"value"`` builds a critic (`Model`); its ``score`` head is initialised as
    transformers' ``_init_weights`` does (weight ``N(0, initializer_range)``, bias 0: verl's
    critic). Raises ``ValueError`` for an unknown family, backend, precision or head, or a head
    the backend does not offer.
    """
    if isinstance(config, dict):
        if "model_type" not in config:
            raise ValueError("config dict has no 'model_type'; add e.g. model_type='qwen2'")
        config = AutoConfig.for_model(**config)
    family = family_of(config)
    backend = _check_backend(backend)
    compute_dtype = _dtype(precision)
    _check_head(head, backend, config)
    if seed is not None:
        torch.manual_seed(seed)
    if head == "value":
        config = copy.deepcopy(config)
        config.update(_VALUE_HEAD)
        module = AutoModelForTokenClassification.from_config(config, dtype=torch.float32)
    else:
        module = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return _model(
        module, family, backend, compute_dtype, device, activation_checkpointing, options, head=head
    )


def from_pretrained(
    model_id: str | os.PathLike[str],
    *,
    backend: str = "transformers",
    precision: str = "fp32",
    device: str | torch.device | None = None,
    activation_checkpointing: bool = False,
    options: Mapping[str, Any] | None = None,
    head: str = "lm",
) -> Model:
    """Load a causal LM of a supported family from a local HF directory or a hub id.

    `model_id` is a directory with ``config.json`` and safetensors weights, or ``hf://org/name`` /
    ``ms://org/name`` (downloaded only when that hub is reachable). `precision`,
    `activation_checkpointing` and `options` are as in `from_hf_config`. A backend that reads its
    own slices of the files when the state is initialised (megatron) gets a skeleton on the meta
    device and the directory, and nothing is loaded here (it checks the values it reads). A causal
    LM's safetensors files are checked first (`check_weights_dir`). `head` ``"value"`` loads a
    critic: the body from a causal LM's (or a critic's) checkpoint, the ``score`` head from a
    critic's or initialised as in `from_hf_config`. Raises ``ValueError`` when the directory has
    no ``config.json``, the family is unknown, a hub id cannot be fetched, the head is unknown or
    not offered by the backend, a critic's checkpoint is loaded without ``head="value"``, or a
    tensor is missing, extra, of another shape, not floating, holding NaN or infinity, or in a
    truncated file (naming the tensor and the file).
    """
    path = resolve_model_dir(model_id)
    config = AutoConfig.from_pretrained(path)
    family = family_of(config)
    backend = _check_backend(backend)
    compute_dtype = _dtype(precision)
    _check_head(head, backend, config)
    critic_dir = any(a.endswith("ForTokenClassification") for a in config.architectures or ())
    if critic_dir and head != "value":
        raise ValueError(
            f"{path} holds a value model ({config.architectures[0]}), not a causal LM; load it "
            "with head='value'"
        )
    found: dict[str, TensorSpec] = {}
    if not critic_dir:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        found = check_weights_dir(skeleton, path)
    if head == "value":
        config.update(_VALUE_HEAD)
        if backends.get(backend).reads_own_weights:
            return _model(
                _critic_skeleton(config, path, critic_dir),
                family,
                backend,
                compute_dtype,
                device,
                activation_checkpointing,
                options,
                path,
                head=head,
            )
        module = AutoModelForTokenClassification.from_pretrained(
            path, config=config, dtype=torch.float32
        )
        check_finite(module.state_dict(), where=f"model {path}", files=found)
        return _model(
            module,
            family,
            backend,
            compute_dtype,
            device,
            activation_checkpointing,
            options,
            head=head,
        )
    if backends.get(backend).reads_own_weights:
        return _model(
            skeleton,
            family,
            backend,
            compute_dtype,
            device,
            activation_checkpointing,
            options,
            path,
        )
    # Straight onto the device the module trains on, in the files' own dtype: transformers
    # casts a tensor to another dtype on the host before copying it over (a 4B bf16 checkpoint:
    # 3.2 s for float32, 1.1 s as stored, on an H200); the exact widening to float32 and the
    # finiteness check then run on the device.
    target = device if device is not None else backends.get(backend).module_device()
    module = AutoModelForCausalLM.from_pretrained(
        path, dtype=_stored_dtype(found), device_map=str(torch.device(target))
    )
    if found:
        check_finite(module.state_dict(), where=f"model {path}", files=found)
    _widen(module)
    return _model(module, family, backend, compute_dtype, device, activation_checkpointing, options)


def _widen(module: PreTrainedModel) -> None:
    """Cast `module` to float32 in place, as loading it with ``dtype=torch.float32`` builds it:
    the loaded tensors widen exactly, and the non-persistent buffers transformers computes
    rather than loads (gemma3's embedding scale, rotary frequencies) are computed again in
    float32 by the model's own initialisation, which skips every tensor it marked as loaded."""
    owners = [m for m in module.modules() if m._non_persistent_buffers_set]
    module.to(torch.float32)
    for owner in owners:
        owner._is_hf_initialized = False
    module.initialize_weights()


def _stored_dtype(found: Mapping[str, TensorSpec]) -> torch.dtype:
    """The one floating dtype every tensor of a checkpoint is stored in (its specs `found`),
    when float32 holds each of its values exactly (bf16, fp16); float32 otherwise."""
    dtypes = {spec.dtype for spec in found.values()}
    if len(dtypes) == 1 and dtypes <= {torch.bfloat16, torch.float16}:
        return dtypes.pop()
    return torch.float32


def _critic_skeleton(config: PretrainedConfig, path: Path, critic_dir: bool) -> torch.nn.Module:
    """A critic's module for a backend that reads its own slices of the files in `path`: on the
    meta device, but for the head when the files are a causal LM's (they lack it), which is
    initialised as transformers' ``from_pretrained`` initialises a missing tensor (the same
    draws from torch's generator, so a seed gives both backends the same head). A critic's
    files are checked as `check_weights_dir` does."""
    with torch.device("meta"):
        module = AutoModelForTokenClassification.from_config(config, dtype=torch.float32)
    if critic_dir:
        check_weights_dir(module, path)
        return module
    for name, child in module.named_children():
        if name != module.base_model_prefix:
            child.to_empty(device="cpu")
            child.apply(module._init_weights)
    return module


def check_weights_dir(skeleton: torch.nn.Module, path: Path) -> dict[str, TensorSpec]:
    """Check the safetensors files of the model directory `path` against `skeleton` (the HF
    module its config builds, on the meta device): every tensor present (tied aliases and the
    keys the model class itself ignores aside), none extra, each of its shape and of a
    floating dtype, no file truncated. Returns the files' specs by name (empty for a directory
    without safetensors, which transformers reads its own way).

    Raises ``ValueError`` naming the tensor, both shapes or dtypes, and the file: transformers
    would initialise a missing tensor at random and drop an extra one with only a log line.
    """
    if not any(path.glob("*.safetensors")):
        return {}
    found = safetensors_specs(path)
    specs, aliases = module_specs(skeleton)
    meta = {n: torch.empty(s.shape, dtype=s.dtype, device="meta") for n, s in specs.items()}
    expected = {n: TensorSpec.of(t) for n, t in revert_weight_conversion(skeleton, meta).items()}
    ignored = [re.compile(p) for p in skeleton._keys_to_ignore_on_load_unexpected or ()]
    optional = set(aliases) | {n for n in found if any(p.search(n) for p in ignored)}
    check_specs(found, expected, where=f"model {path}", optional=optional, cast=True)
    return found


def _model(
    module: torch.nn.Module,
    family: str,
    backend: str,
    compute_dtype: torch.dtype,
    device: str | torch.device | None,
    activation_checkpointing: bool,
    options: Mapping[str, Any] | None = None,
    weights_dir: Path | None = None,
    *,
    head: str = "lm",
) -> Model:
    backends.get(backend).adopt(module)
    if head == "value":
        # what a backend that saves the config by itself (megatron) writes: files that load
        # back as a critic
        module.config.architectures = [type(module).__name__]
    module.train()  # from_pretrained returns eval mode; training wants dropout as configured
    if activation_checkpointing:
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if weights_dir is None:
        module = module.to(device or backends.get(backend).module_device())
    return Model(
        module,
        family,
        backend,
        compute_dtype,
        options=dict(options or {}),
        weights_dir=weights_dir,
        head=head,
    )


def resolve_model_dir(model_id: str | os.PathLike[str]) -> Path:
    """A local directory holding the model `model_id` names.

    Local paths are returned as they are; ``hf://`` ids go through ``huggingface_hub`` and
    ``ms://`` ids through ``modelscope`` (when installed). Raises ``ValueError`` with the cause
    when a directory lacks ``config.json`` or a download fails (e.g. no hub is reachable).
    """
    text = os.fspath(model_id)
    for scheme in ("hf", "ms"):
        if text.startswith(f"{scheme}://"):
            return _download(scheme, text.removeprefix(f"{scheme}://"))
    path = Path(text)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model {text!r} is not a directory with a config.json; pass a local HF model "
            "directory, or a hub id as hf://org/name or ms://org/name"
        )
    return path


def _download(scheme: str, repo_id: str) -> Path:
    """Fetch `repo_id` from the Hugging Face hub (``hf``) or ModelScope (``ms``)."""
    try:
        if scheme == "hf":
            from huggingface_hub import snapshot_download
        else:
            from modelscope import snapshot_download
    except ImportError as e:
        raise ValueError(
            f"{scheme}://{repo_id} needs the `modelscope` package; pip install modelscope, "
            "or pass a local model directory"
        ) from e
    kwargs = {"etag_timeout": 10} if scheme == "hf" else {}
    try:
        return Path(snapshot_download(repo_id, **kwargs))
    except Exception as e:
        raise ValueError(
            f"could not download {scheme}://{repo_id} ({type(e).__name__}: {e}); is the hub "
            "reachable? Otherwise pass a local model directory"
        ) from e


def _check_backend(backend: str) -> str:
    """The backend's canonical name. Raises ``ValueError`` for an unknown one."""
    return backends.canonical(backend)


def _check_head(head: str, backend: str, config: PretrainedConfig) -> None:
    """Raise ``ValueError`` for a `head` outside `HEADS`, one `backend` does not build (naming
    the backends that do), or a value head on a family transformers has no token-classification
    model for (the critic's body and head come from it)."""
    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}; use one of {', '.join(HEADS)}")
    if head == "value" and type(config) not in AutoModelForTokenClassification._model_mapping:
        raise ValueError(
            f"head='value' on model_type {config.model_type!r}: transformers has no "
            "token-classification model for it, which a critic is built from; use a family "
            "that has one (llama, mistral, qwen2, qwen3, qwen3_moe...) or head='lm'"
        )
    if head not in backends.get(backend).heads:
        offering = [name for name in backends.names() if head in backends.get(name).heads]
        raise ValueError(
            f"backend={backend!r} has no {head!r} head; build this model with "
            f"backend={offering[0]!r} (which has it)"
        )


def _dtype(precision: str) -> torch.dtype:
    if precision not in _DTYPES:
        raise ValueError(f"unknown precision {precision!r}; use one of {', '.join(_DTYPES)}")
    return _DTYPES[precision]
