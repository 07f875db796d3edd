"""The model classes' construction: option checks, the device mesh, the core model.

The classes accept upstream's constructor arguments; this module checks the precision both take
(`check_precision`), rejects the `TransformersModel` options the core does not do (fp8, grad
scaler, DDP options, non-causal-LM classes; `check_options`), joins the distributed world, and
builds the `twinkle_fn` model from a checkpoint directory / hub id or from an HF config with
overridden fields.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from transformers import AutoConfig, PretrainedConfig

import twinkle_fn as tf
from twinkle.device_mesh import DeviceMesh
from twinkle_fn.distributed import init_distributed, world_size

PRECISIONS = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}
STRATEGIES = ("accelerate", "native_fsdp")
FSDP_OPTIONS = ("activation_checkpointing", "expert_parallel")
# upstream's ``fsdp_config["expert_parallel"]`` keys; the mesh's ep_size decides the split.
EXPERT_PARALLEL_OPTIONS = ("enabled", "router_dtype", "keep_router_logits")


def check_precision(mixed_precision: str) -> None:
    """Raises ``ValueError`` unless `mixed_precision` is one of `PRECISIONS`."""
    if mixed_precision not in PRECISIONS:
        raise ValueError(
            f"mixed_precision must be one of {', '.join(PRECISIONS)}, got {mixed_precision!r}"
        )


def check_options(
    model_cls: Any,
    strategy: str,
    ddp_config: Mapping[str, Any] | None,
    fsdp_config: Mapping[str, Any] | None,
    grad_scaler_config: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """Check `TransformersModel`'s options (its precision: `check_precision`); returns
    `fsdp_config` as a dict.

    Raises ``ValueError`` for a `model_cls` that is not a causal LM, an unknown `strategy`, any
    `ddp_config` or `grad_scaler_config`, unknown `fsdp_config` keys and a bad
    ``fsdp_config["expert_parallel"]`` (`check_expert_parallel`).
    """
    name = model_cls if isinstance(model_cls, str) else getattr(model_cls, "__name__", "")
    if not name.endswith("ForCausalLM"):
        raise ValueError(
            f"model_cls={model_cls!r}: this build trains causal LMs; use AutoModelForCausalLM"
        )
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if ddp_config:
        raise ValueError(
            f"ddp_config {dict(ddp_config)} is not supported: data parallelism is FSDP2 "
            "through the core (dp alone shards gradients and optimizer state, ZeRO-2)"
        )
    if grad_scaler_config:
        raise ValueError(
            "grad_scaler_config is not supported: the core keeps float32 master weights and "
            "sums losses in float32; use mixed_precision='bf16'"
        )
    fsdp_config = dict(fsdp_config or {})
    unknown = sorted(set(fsdp_config) - set(FSDP_OPTIONS))
    if unknown:
        raise ValueError(f"fsdp_config keys {unknown} are not supported; known: {FSDP_OPTIONS}")
    _check_expert_parallel_options(fsdp_config.get("expert_parallel") or {})
    return fsdp_config


def _check_expert_parallel_options(options: Mapping[str, Any]) -> None:
    unknown = sorted(set(options) - set(EXPERT_PARALLEL_OPTIONS))
    if unknown:
        raise ValueError(
            f"fsdp_config['expert_parallel'] keys {unknown} are not supported; known: "
            f"{EXPERT_PARALLEL_OPTIONS}"
        )
    for key in ("enabled", "keep_router_logits"):
        # 0 / 1 too: upstream's CLI casts ``--enable-ep 1`` to an int, which its switch reads
        value = options.get(key, True)
        if not (isinstance(value, bool) or (type(value) is int and value in (0, 1))):
            raise ValueError(
                f"fsdp_config['expert_parallel']['{key}'] must be a bool (or 0 / 1), got "
                f"{options[key]!r}"
            )
    if options.get("router_dtype", "fp32") != "fp32":
        raise ValueError(
            f"fsdp_config['expert_parallel']['router_dtype']={options['router_dtype']!r} is not "
            "supported: the routers take their softmax in float32 (as transformers' do); use 'fp32'"
        )


def check_expert_parallel(fsdp_config: Mapping[str, Any], mesh: DeviceMesh) -> None:
    """Check ``fsdp_config["expert_parallel"]["enabled"]`` against the mesh, which decides
    expert parallelism (its ``ep_size``; the transformers backend splits the MoE experts over
    it). Raises ``ValueError`` for ``enabled=False`` with ``ep_size > 1``."""
    options = fsdp_config.get("expert_parallel") or {}
    ep = mesh.core_mesh.ep
    if not options.get("enabled", True) and ep > 1:
        raise ValueError(
            f"fsdp_config['expert_parallel']['enabled']=False with a mesh of ep_size={ep}: the "
            "mesh splits the experts; use ep_size=1 (no expert parallelism) or enabled=True"
        )


def device_mesh(mesh: DeviceMesh | None) -> DeviceMesh:
    """`mesh`, by default dp over the world, after joining the launcher's world (torchrun;
    nothing on one process). Raises ``ValueError`` when the mesh does not match the world."""
    init_distributed()
    mesh = mesh or DeviceMesh.from_sizes(dp_size=world_size())
    mesh.core_mesh.validate(world_size())
    return mesh


def build_model(
    model_id: str | os.PathLike[str] | None,
    config: PretrainedConfig | None,
    overrides: dict[str, Any],
    mixed_precision: str,
    fsdp_config: Mapping[str, Any],
    seed: int | None,
    *,
    backend: str = "transformers",
    options: Mapping[str, Any] | None = None,
    head: str = "lm",
) -> tf.models.Model:
    """The core model from `model_id` (its own config.json), else from `config` with the
    `overrides` fields set (random init from `seed`), for `backend` with its `options`, ending
    in `head` (``"value"``: a critic, see `twinkle_fn.models.from_pretrained`).
    ``dtype``/``torch_dtype`` are popped from `overrides` first: the parameters' dtype.

    Raises ``ValueError`` for fields next to a `model_id`, a `config` next to it that describes
    another model (`_check_same_model`), for neither given, and for a field that is not one of
    `config`'s.
    """
    dtype = overrides.pop("dtype", overrides.pop("torch_dtype", None))
    build = dict(
        precision=PRECISIONS[mixed_precision],
        activation_checkpointing=bool(fsdp_config.get("activation_checkpointing", False)),
        backend=backend,
        options=options,
        head=head,
    )
    if model_id is not None:
        if overrides:
            raise ValueError(
                "with model_id, the directory's config.json is used; config overrides "
                f"{sorted(overrides)} are not supported (build from config= instead)"
            )
        if config is not None:
            _check_same_model(config, model_id)
        model = tf.models.from_pretrained(model_id, **build)
    elif config is not None:
        model = tf.models.from_hf_config(_override(config, overrides), seed=seed, **build)
    else:
        raise ValueError("the model needs model_id=<dir or hub id> or config=")
    if dtype is not None:
        model.module.to(dtype)
    return model


# Config fields that change how a forward runs (generation), not which model the files hold.
_RUNTIME_FIELDS = frozenset({"use_cache", "transformers_version", "architectures", "dtype"})


def _check_same_model(config: PretrainedConfig, model_id: str | os.PathLike[str]) -> None:
    """Accept `config` next to `model_id` (upstream's ``TransformersModel(model_id, config=
    AutoConfig.from_pretrained(model_id))``, e.g. with ``use_cache`` off) when it describes the
    directory's model: every field but `_RUNTIME_FIELDS` (and private ones) as in its
    config.json. Raises ``ValueError`` naming the fields that differ."""
    theirs = AutoConfig.from_pretrained(tf.models.resolve_model_dir(model_id)).to_dict()
    mine = config.to_dict()

    def kept(key: str) -> bool:
        return key not in _RUNTIME_FIELDS and not key.startswith("_")

    differ = sorted(k for k in set(mine) | set(theirs) if kept(k) and mine.get(k) != theirs.get(k))
    if differ:
        raise ValueError(
            f"config= next to model_id={os.fspath(model_id)!r} differs from the directory's "
            f"config.json in {differ[:5]}: the weights are loaded with the directory's config; "
            "pass model_id alone, or config= alone to build a new model"
        )


def _override(config: PretrainedConfig, fields: Mapping[str, Any]) -> PretrainedConfig:
    """A copy of `config` with `fields` set. Raises ``ValueError`` for an unknown field."""
    unknown = [k for k in fields if not hasattr(config, k)]
    if unknown:
        raise ValueError(
            f"unknown TransformersModel arguments {unknown}: neither constructor options nor "
            f"fields of {type(config).__name__}"
        )
    config = type(config).from_dict(config.to_dict())
    for key, value in fields.items():
        setattr(config, key, value)
    return config
