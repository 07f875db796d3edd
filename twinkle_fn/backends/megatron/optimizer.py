"""megatron-core's distributed optimizer as a `GradientTransformation` (`megatron_optimizer`).

``tf.init`` builds megatron-core's ``DistributedOptimizer`` over the model chunks (fp32 main
params, optimizer state sharded over data-parallel ranks, clipping by the true global norm across
tp / pp / ep), and the learning rate follows a `twinkle_fn.schedules` schedule the way
``OptimizerParamScheduler`` sets it. The megatron backend's ``step`` applies it
(`megatron_update`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import optree
import torch
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from torch import Tensor

from twinkle_fn.backends.megatron import multi_tensor, param_sync
from twinkle_fn.backends.megatron.placement import PLACEMENT_ATTR, MegatronPlacement
from twinkle_fn.optim import GradientTransformation, Schedule
from twinkle_fn.optim.base import advance_counter, check_lr, check_nonnegative, lr_at
from twinkle_fn.pytree import NAMESPACE


@dataclasses.dataclass(frozen=True, eq=False)
class _Hyper:
    lr: float | Schedule
    weight_decay: float


@optree.register_pytree_node_class(namespace=NAMESPACE)
@dataclasses.dataclass(frozen=True, eq=False)
class MegatronOptState:
    """The state of `megatron_optimizer`: megatron-core's optimizer and its tensors.

    Children: ``count`` (int64, updates applied) and ``lr`` (float64, the last update's lr),
    0-d CPU tensors; ``slots``: per parameter name, the optimizer's tensors for the part of it
    this data rank owns (``exp_avg``, ``exp_avg_sq``, ``step``; ``main_param`` when the fp32
    master copy is a separate tensor) -- the very tensors the optimizer steps. Static: the
    megatron ``ChainedOptimizer`` and the hyper-parameters.
    """

    count: Tensor
    lr: Tensor
    slots: dict[str, dict[str, Tensor]]
    optimizer: Any = dataclasses.field(repr=False)
    hyper: _Hyper = dataclasses.field(repr=False)

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[str, ...]]:
        """optree protocol: tensor children, static metadata, child names."""
        children = (self.count, self.lr, self.slots)
        return children, (self.optimizer, self.hyper), ("count", "lr", "slots")

    @classmethod
    def tree_unflatten(cls, meta: tuple[Any, ...], children: tuple[Any, ...]) -> MegatronOptState:
        """optree protocol: rebuild from `tree_flatten`'s output."""
        return cls(*children, *meta)


def megatron_optimizer(
    lr: float | Schedule,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    clip_grad: float = 1.0,
    loss_scale: float | None = None,
    initial_loss_scale: float = 2.0**32,
) -> GradientTransformation:
    """AdamW through megatron-core's distributed optimizer, for the megatron backend.

    It keeps float32 main parameters and moments (12 bytes a parameter besides the bf16 model
    and its float32 grad buffer). Its bf16-moment mode (``use_precision_aware_optimizer``)
    needs TransformerEngine's FusedAdam, which twinkle does not depend on, so it is not
    offered; for full fine-tuning that must fit one GPU use `twinkle_fn.optim.adamw_bf16`
    instead, which the backend applies to the model's own bf16 parameters (bf16 moments,
    stochastic rounding: 10 bytes a parameter in all).

    ``init`` (called by ``tf.init`` with the parameters of a model prepared by the megatron
    backend) builds ``get_megatron_optimizer`` over its model chunks: fp32 main parameters,
    Adam moments sharded over data-parallel ranks, gradients clipped to global norm `clip_grad`
    (0 disables; the norm spans tp, pp and ep shards, each element once), decoupled weight decay
    on matrices only (megatron skips biases and 1-d tensors, as `tf.optim.default_decay_mask`
    does for these families). `lr` is a float or a `twinkle_fn.schedules` schedule called with
    the number of updates applied; every update writes it (times the group's ``lr_mult``) into
    the optimizer's parameter groups, as ``OptimizerParamScheduler.step`` does. fp16 only:
    `loss_scale` is a constant loss scale, or None for megatron's dynamic scaler starting at
    `initial_loss_scale` (an update that overflows is skipped: parameters, moments and the
    schedule's count stay, and ``step`` reports a NaN ``grad_norm``). ``update`` is applied
    by the backend's ``step``; calling it directly raises ``TypeError``. Raises ``ValueError``
    for an out-of-range hyper-parameter, and ``init`` ``TypeError`` for parameters that do not
    come from the megatron backend.
    """
    lr = check_lr(lr)
    hyper = _Hyper(lr, check_nonnegative("weight_decay", weight_decay))
    adam = dict(
        adam_beta1=check_nonnegative("b1", b1, below_one=True),
        adam_beta2=check_nonnegative("b2", b2, below_one=True),
        adam_eps=check_nonnegative("eps", eps),
        clip_grad=check_nonnegative("clip_grad", clip_grad),
        loss_scale=None if loss_scale is None else check_nonnegative("loss_scale", loss_scale),
        initial_loss_scale=check_nonnegative("initial_loss_scale", initial_loss_scale),
    )

    def init(params: Mapping[str, Tensor]) -> MegatronOptState:
        placement = _placement_of(params)
        if placement.overlap_param_gather:
            # its fp32 main parameters are copied from the model's: no gather may be in flight
            param_sync.finish(placement.chunks)
        dtype = placement.compute_dtype
        config = OptimizerConfig(
            optimizer="adam",
            lr=lr_at(lr, torch.zeros((), dtype=torch.int64)),
            weight_decay=hyper.weight_decay,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            params_dtype=dtype,
            use_distributed_optimizer=True,
            **adam,
        )
        multi_tensor.install()  # no host sync per gradient in the clip (without TE or apex)
        optimizer = get_megatron_optimizer(config, placement.chunks)
        if config.fp16:
            placement.module.config.grad_scale_func = optimizer.scale_loss
        _fuse_torch_adams(optimizer)
        _init_adam_states(optimizer)
        count, last_lr = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.float64)
        return MegatronOptState(count, last_lr, _slots(optimizer, params), optimizer, hyper)

    def update(updates: Any, state: Any, params: Any = None) -> Any:
        raise TypeError(
            "megatron_optimizer is applied by the megatron backend's tf.step; build the model "
            "with backend='megatron' and call tf.step(state, grads)"
        )

    def next_lr(state: MegatronOptState) -> float:
        return lr_at(lr, state.count)

    return GradientTransformation(init, update, next_lr)


def _placement_of(params: Mapping[str, Tensor]) -> MegatronPlacement:
    refs = [getattr(p, PLACEMENT_ATTR, None) for p in params.values()]
    placements = {id(None if ref is None else ref()) for ref in refs}
    placement = refs[0]() if refs and refs[0] is not None else None
    if placement is None or len(placements) != 1:
        raise TypeError(
            "megatron_optimizer needs the parameters of one model prepared by the megatron "
            "backend: build it with tf.models.from_hf_config(..., backend='megatron') and "
            "call tf.init(model, megatron_optimizer(...), mesh)"
        )
    return placement


def _torch_adams(optimizer: Any) -> list[torch.optim.Adam]:
    """The torch Adam/AdamW optimizers inside megatron's (none when TE or apex provided it)."""
    inner = (sub.optimizer for sub in optimizer.chained_optimizers)
    return [o for o in inner if isinstance(o, torch.optim.Adam | torch.optim.AdamW)]


def _fuse_torch_adams(optimizer: Any) -> None:
    """Step megatron's torch AdamW with torch's fused kernel. Without TE or apex megatron builds
    it with the default, foreach, which makes about ten passes over the float32 parameters,
    gradients and moments: 37.8 ms of a 1.5B step on an H200, where one fused pass reads and
    writes each once."""
    for adam in _torch_adams(optimizer):
        for group in adam.param_groups:
            if not group.get("capturable") and not group.get("differentiable"):
                group.update(fused=True, foreach=False)


def _init_adam_states(optimizer: Any) -> None:
    """Create torch Adam's per-parameter state now rather than at the first step, exactly as
    ``torch.optim.AdamW`` would (the fused kernel's step count on the parameter's device), so
    the state tree is complete from ``tf.init`` on. TransformerEngine's and apex's optimizers
    keep their lazy initialisation."""
    for adam in _torch_adams(optimizer):
        for group in adam.param_groups:
            if group.get("capturable") or group.get("amsgrad"):
                continue
            fused = bool(group.get("fused"))
            for p in group["params"]:
                if not adam.state[p]:
                    step = (
                        torch.zeros((), dtype=torch.float32, device=p.device)
                        if fused
                        else torch.tensor(0.0, dtype=_scalar_dtype())
                    )
                    adam.state[p].update(
                        step=step,
                        exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                        exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format),
                    )


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _slots(optimizer: Any, params: Mapping[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    """Per parameter name, the optimizer tensors of this data rank's part of it."""
    names = {id(p): n for n, p in params.items()}
    slots: dict[str, dict[str, Tensor]] = {}
    for sub in optimizer.chained_optimizers:
        if not isinstance(sub, DistributedOptimizer):
            raise TypeError(f"expected megatron's DistributedOptimizer, got {type(sub).__name__}")
        for model_param, (group, order) in sub.model_param_group_index_map.items():
            main = sub.optimizer.param_groups[group]["params"][order]
            slot = {k: v for k, v in sub.optimizer.state[main].items() if isinstance(v, Tensor)}
            if main.dtype != model_param.dtype:
                slot["main_param"] = main
            slots[names[id(model_param)]] = slot
    return slots


def refresh_slots(placement: MegatronPlacement, opt: MegatronOptState) -> MegatronOptState:
    """`opt` with its slots re-read from megatron's optimizer (after a checkpoint load, which
    may replace the optimizer's tensors)."""
    names = dict(placement.module.named_parameters())
    return dataclasses.replace(opt, slots=_slots(opt.optimizer, names))


def megatron_update(
    placement: MegatronPlacement, opt: MegatronOptState, num_tokens: Tensor
) -> tuple[Tensor, MegatronOptState]:
    """Reduce the DDP grad buffers, divide them by `num_tokens` (0-d int64, every data rank's
    supervised tokens) and step megatron's optimizer at the schedule's lr.

    Returns the global grad norm before clipping (0-d float32, on the device unless megatron
    read it on the host; NaN when an fp16 overflow skipped the update, which leaves the count
    unchanged) and the new state.
    """
    finalize_model_grads(placement.chunks)
    multi_tensor.scale_grad_buffers(placement.chunks, 1.0 / num_tokens.clamp(min=1).double())
    lr = lr_at(opt.hyper.lr, opt.count)
    optimizer = opt.optimizer
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
        group["weight_decay"] = opt.hyper.weight_decay * group.get("wd_mult", 1.0)
    ok, grad_norm, _ = optimizer.step()
    if ok:
        advance_counter(opt.count, opt.lr, lr)
    if grad_norm is None:
        norm = torch.tensor(float("nan"))
    elif isinstance(grad_norm, Tensor):  # on the device (`multi_tensor`, TE): not read here
        norm = grad_norm.reshape(()).float()
    else:
        norm = torch.tensor(grad_norm, dtype=torch.float32)
    names = dict(placement.module.named_parameters())
    return norm, dataclasses.replace(opt, slots=_slots(optimizer, names))
