"""`MegatronModel`'s settings in upstream's words, as the core's megatron backend takes them.

Upstream configures megatron through its own objects (``OptimizerConfig``, ``DDPConfig``,
``OptimizerParamScheduler``, the recompute fields); here each becomes what the core runs or a
``ValueError`` before anything is built: `optimizer_spec` (megatron's distributed Adam),
`check_scheduler`, `check_ddp_config` and `model_options` (the core model's megatron options).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import twinkle_fn as tf
from twinkle.model import optim

OPTIMIZERS = ("default", "MegatronDistributedOptimizer")
SCHEDULERS = ("default", "OptimizerParamScheduler")
DEFAULT_LR = 1e-4  # upstream's OptimizerConfig default
# Upstream's set_optimizer names (megatron's OptimizerConfig) -> `megatron_optimizer`'s.
_OPTIMIZER_ARGS = {
    "weight_decay": "weight_decay",
    "adam_beta1": "b1",
    "adam_beta2": "b2",
    "adam_eps": "eps",
    "clip_grad": "clip_grad",
    "loss_scale": "loss_scale",
    "initial_loss_scale": "initial_loss_scale",
}
# What the core's DDP does (upstream's defaults); other values are refused. overlap_grad_reduce
# and overlap_param_gather are the core's options of those names (either value).
_CORE_OPTIONS = ("overlap_grad_reduce", "overlap_param_gather")
_DDP_CONFIG = {
    "grad_reduce_in_fp32": True,
    "use_distributed_optimizer": True,
}


def optimizer_spec(optimizer_cls: Any, **kwargs: Any) -> optim.OptimizerSpec:
    """Megatron's distributed Adam with upstream's ``OptimizerConfig`` arguments (``lr``
    default 1e-4, ``weight_decay``, ``adam_beta1``/``adam_beta2``/``adam_eps``, ``clip_grad``
    default 1.0, ``loss_scale``, ``initial_loss_scale``).

    Raises ``ValueError`` for an optimizer other than 'default' / 'MegatronDistributedOptimizer'
    or an out-of-range value, ``TypeError`` for an unknown argument.
    """
    name = optim._name(optimizer_cls)
    if name not in OPTIMIZERS:
        raise ValueError(
            f"MegatronModel does not support optimizer {optimizer_cls!r}: megatron trains with "
            f"its distributed optimizer only; pass one of {', '.join(map(repr, OPTIMIZERS))}"
        )
    lr = kwargs.pop("lr", DEFAULT_LR)
    unknown = sorted(set(kwargs) - set(_OPTIMIZER_ARGS))
    if unknown:
        raise TypeError(
            f"set_optimizer arguments {unknown} are not supported; known: lr, "
            f"{', '.join(_OPTIMIZER_ARGS)}"
        )
    spec = optim.OptimizerSpec(
        OPTIMIZERS[1], lr, {_OPTIMIZER_ARGS[k]: v for k, v in kwargs.items()}
    )
    tf.optim.megatron_optimizer(lr, **spec.kwargs)  # check the values now, not at the first step
    return spec


def check_ddp_config(ddp_config: Mapping[str, Any] | None) -> None:
    """Raises ``ValueError`` for a `ddp_config` entry the core's megatron DDP does not run."""
    for key, value in (ddp_config or {}).items():
        if key in _CORE_OPTIONS and isinstance(value, bool):
            continue
        if _DDP_CONFIG.get(key, object()) != value:
            raise ValueError(
                f"ddp_config {key}={value!r} is not supported: the core's megatron DDP runs "
                f"with {_DDP_CONFIG}"
            )


def _recompute(granularity: str | None, method: str | None, num_layers: int | None) -> dict:
    """Megatron's recompute fields: none without a granularity, only it for 'selective'."""
    if granularity is None:
        return {}
    if granularity == "selective":
        return {"recompute_granularity": granularity}
    return dict(
        recompute_granularity=granularity,
        recompute_method=method,
        recompute_num_layers=num_layers,
    )


def check_scheduler(scheduler_cls: Any) -> None:
    """Raises ``ValueError`` for a scheduler other than megatron's ``OptimizerParamScheduler``
    ('default' / 'OptimizerParamScheduler'), naming the accepted ones."""
    if optim._name(scheduler_cls) not in SCHEDULERS:
        raise ValueError(
            f"MegatronModel does not support lr scheduler {scheduler_cls!r}: megatron "
            f"schedules with OptimizerParamScheduler only; pass one of "
            f"{', '.join(map(repr, SCHEDULERS))}"
        )


def model_options(
    ddp_config: Mapping[str, Any] | None,
    recompute_granularity: str | None,
    recompute_method: str | None,
    recompute_num_layers: int | None,
    extra: Mapping[str, Any],
) -> dict[str, Any]:
    """The core model's megatron options: the recompute fields, the core's own DDP options of
    `ddp_config` (``overlap_grad_reduce``, ``overlap_param_gather``; `check_ddp_config` has
    refused the rest), then `extra` (``TransformerConfig`` fields, ``num_micro_batches``...)."""
    options = _recompute(recompute_granularity, recompute_method, recompute_num_layers)
    options.update({k: v for k, v in (ddp_config or {}).items() if k in _CORE_OPTIONS})
    options.update(extra)
    return options
