"""The megatron backend's optimizer step (`update`): finish reducing a call's gradients, divide
them by every data rank's supervised tokens and apply the optimizer, megatron-core's
distributed one (`twinkle_fn.backends.megatron.optimizer`) or a plain `twinkle_fn.optim`
transform on whole parameters."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from torch import Tensor

from twinkle_fn.backends.megatron import multi_tensor, param_sync
from twinkle_fn.backends.megatron.compute import live_grads
from twinkle_fn.backends.megatron.optimizer import MegatronOptState, megatron_update
from twinkle_fn.backends.megatron.placement import MegatronPlacement, model_placement
from twinkle_fn.mesh import Mesh
from twinkle_fn.optim import apply_updates, current_lr, materialise
from twinkle_fn.optim.base import pending_scale
from twinkle_fn.pytree import tree_global_norm
from twinkle_fn.state import Grads, TrainState, next_key


def update(state: TrainState, grads: Grads) -> tuple[TrainState, dict[str, Any]]:
    """Finish reducing `grads`, divide by every data rank's tokens, apply the optimizer.

    Returns the new state and ``info`` with ``loss``, ``grad_norm`` (before clipping; NaN
    when an fp16 overflow skipped the update), ``num_tokens`` and ``lr``. Raises
    ``ValueError`` for stale grads, grads reduced for another kind of optimizer, or a
    non-megatron transform on a mesh that splits parameters.
    """
    placement = model_placement(state.model)
    live_grads(placement, grads, "step")
    opt = state.opt_state
    if not isinstance(opt, MegatronOptState):
        _check_whole_params(placement.mesh)
    if placement.overlap_grad_reduce and any(
        c.force_all_reduce == isinstance(opt, MegatronOptState) for c in placement.chunks
    ):
        raise ValueError(
            "these gradients were reduced for another optimizer kind (fwd_bwd ran with a "
            "state whose optimizer differs from this one's); step with the same state"
        )
    placement.live_grads = None
    totals = torch.stack([grads.loss_sum.double(), grads.num_tokens.double()])
    # Over data ranks only: fwd_bwd's totals already sum the context-parallel ranks.
    dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
    loss_sum, num_tokens = totals[0], totals[1].long()
    if isinstance(opt, MegatronOptState):
        grad_norm, opt = megatron_update(placement, opt, num_tokens)
    else:
        grad_norm, opt = _transform_update(state, placement, grads, num_tokens)
    if placement.overlap_param_gather:
        # a plain transform updated whole parameters on every rank: nothing to gather
        sync = param_sync.start if isinstance(opt, MegatronOptState) else param_sync.finish
        sync(placement.chunks)
    new = state.replace(opt_state=opt, step=state.step + 1, rng=next_key(state.rng))
    info = {
        "loss": (loss_sum / num_tokens.clamp(min=1)).float(),
        "grad_norm": grad_norm,
        "num_tokens": num_tokens,
        "lr": current_lr(opt),
    }
    return new, info


def _check_whole_params(mesh: Mesh) -> None:
    if mesh.tp > 1 or mesh.pp > 1 or mesh.ep > 1:
        raise ValueError(
            f"a twinkle_fn.optim transform needs whole parameters on every rank, but {mesh} "
            "splits them (its global norm would see only local shards); use "
            "twinkle_fn.backends.megatron.megatron_optimizer(...)"
        )


def _transform_update(
    state: TrainState, placement: MegatronPlacement, grads: Grads, num_tokens: Tensor
) -> tuple[Tensor, Any]:
    finalize_model_grads(placement.chunks, force_all_reduce=True)
    inv = 1.0 / num_tokens.clamp(min=1).double()
    deferred = state.tx.takes_scaled  # the division stays pending (`ScaledUpdates`)
    if not deferred:
        multi_tensor.scale_grad_buffers(placement.chunks, inv)
    g = {n: t.to(state.params[n].dtype) for n, t in grads.params.items()}
    updates, grad_norm = pending_scale(g, inv) if deferred else (g, tree_global_norm(g))
    updates, opt = state.tx.update(updates, state.opt_state, state.params)
    apply_updates(state.params, materialise(updates))
    return grad_norm, opt
