"""The functional API: `init`, `shard`, `fwd_bwd`, `step`.

Each function is pure in meaning and in-place underneath (see `twinkle_fn.state`): `fwd_bwd`
never touches the state; `step` consumes the state and the grads (``donate=True``) or works on
copies (``donate=False``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from twinkle_fn.backends import fsdp, hf
from twinkle_fn.losses import LossOutput
from twinkle_fn.mesh import Mesh
from twinkle_fn.models import Model
from twinkle_fn.optim import GradientTransformation, apply_updates, current_lr
from twinkle_fn.optim.base import foreach_mul_
from twinkle_fn.pytree import tree_global_norm, tree_leaves
from twinkle_fn.state import Grads, TrainState


def init(
    model: Model, tx: GradientTransformation, mesh: Mesh | None = None, *, seed: int = 0
) -> TrainState:
    """A fresh train state: the model's trainable parameters, ``tx.init`` of them, step 0.

    Trainable means ``requires_grad`` (frozen base weights under LoRA stay out of the state and
    the optimizer). `mesh` defaults to one process (on several ranks: a whole, unsharded copy
    per rank); a larger mesh must match the world, and the model is first sharded over it, so
    the optimizer state is born sharded like its parameters. Every rank must call this with the
    same model weights. Raises ``ValueError`` when the model has no trainable parameter or the
    mesh does not fit the world.
    """
    mesh = mesh or Mesh()
    if mesh.world_size > 1 and model.placement is None:
        model = fsdp.parallelize(model, mesh)
    params = {n: p for n, p in model.module.named_parameters() if p.requires_grad}
    if not params:
        raise ValueError("the model has no trainable parameter (every requires_grad is False)")
    return TrainState(
        params=params,
        opt_state=tx.init(params),
        step=torch.zeros((), dtype=torch.int64),
        rng=torch.tensor(seed, dtype=torch.int64),
        model=model,
        tx=tx,
        mesh=mesh,
    )


def shard(state: TrainState, mesh: Mesh) -> TrainState:
    """`state` placed on `mesh`: parameters and optimizer state sharded by the family's plan.

    On one process, or when `state` already lives on `mesh`, `state` is returned as it is.
    Otherwise the state is donated: its module is sharded in place (TP plan, then FSDP2) and
    each optimizer-state tensor is split exactly like its parameter. Every rank must call it
    with the same full state. Raises ``ValueError`` when the mesh does not match the world, asks
    for axes this backend lacks, or does not divide the model.
    """
    state.check_alive()
    if mesh.world_size == 1 or state.mesh == mesh:
        return state
    if state.model.placement is not None:
        raise ValueError(
            f"this state is already sharded over {state.mesh}; to move it to {mesh}, save it "
            "with tf.checkpoint.save and load it into a state initialised on the new mesh"
        )
    full_opt, step, rng = tree_leaves(state.opt_state), state.step, state.rng
    new = init(state.model, state.tx, mesh)
    state.donate("shard")
    for full, leaf in zip(full_opt, tree_leaves(new.opt_state), strict=True):
        fsdp.copy_into_shard(leaf, full)
    return new.replace(step=step.clone(), rng=rng.clone())


def unshard(state: TrainState) -> dict[str, torch.Tensor]:
    """The trainable parameters as whole tensors (a collective on several ranks: call it on all).

    On one process these are detached views of the state's own tensors.
    """
    state.check_alive()
    return fsdp.unshard(state.params)


def fwd_bwd(
    state: TrainState,
    batch: Mapping[str, torch.Tensor],
    accum: Grads | None = None,
    *,
    donate: bool = True,
) -> tuple[Grads, dict[str, torch.Tensor]]:
    """Gradients of the token-summed loss of `batch`; the state is never modified.

    `batch` is a padded (``input_ids``, ``labels``, ``attention_mask``, ``position_ids``, each
    ``[B, T]``) or packed (``[1, T]`` plus ``cu_seqlens``) batch with labels already shifted.
    With `accum`, this batch's gradients are added to it: `accum` is donated (reusing it raises)
    unless ``donate=False``. Returns ``(grads, aux)``, aux holding this micro-batch's
    ``loss_sum`` and ``num_tokens``. Raises `DonatedError` for a donated state or accum.
    """
    state.check_alive()
    if accum is not None:
        accum.check_alive()
        accum = _take(accum, "fwd_bwd", donate)
    return hf.fwd_bwd(state, batch, accum)


@torch.no_grad()
def evaluate(state: TrainState, batch: Mapping[str, torch.Tensor]) -> LossOutput:
    """The token-summed loss and token count of `batch` under `state`, without gradients.

    Dropout and other train-mode behaviour follow the module's mode. Raises `DonatedError` for
    a donated state.
    """
    state.check_alive()
    return hf.loss_of(state, batch)


def step(
    state: TrainState, grads: Grads, *, donate: bool = True
) -> tuple[TrainState, dict[str, Any]]:
    """Apply one optimizer update from `grads`, normalised by their total token count.

    The gradients of the token sums are divided once by the number of supervised tokens of every
    accumulated micro-batch, then handed to ``state.tx``. `state` and `grads` are donated unless
    ``donate=False``. Returns the new state and ``info`` with ``loss`` (token mean), ``grad_norm``
    (before clipping), ``num_tokens`` (device tensors: no host sync) and ``lr`` (a float, or None
    when the transform has no learning rate).
    """
    state.check_alive()
    grads.check_alive()
    if not donate and state.model.placement is not None:
        raise ValueError(
            "step(donate=False) copies the state, but a sharded model computes with one set of "
            "parameters; use donate=True (save a checkpoint to keep an earlier state)"
        )
    return _update(_take(state, "step", donate), _take(grads, "step", donate))


def _take[T: (TrainState, Grads)](obj: T, by: str, donate: bool) -> T:
    """The object a call may update in place: `obj`'s buffers (donating it) or a copy."""
    if not donate:
        return obj.copy()
    alias = obj.replace()
    obj.donate(by)
    return alias


def _update(state: TrainState, grads: Grads) -> tuple[TrainState, dict[str, Any]]:
    # Each data-parallel rank saw its own tokens; every rank normalises by all of them.
    placement = state.model.placement
    num_tokens = fsdp.all_reduce_dp(grads.num_tokens, placement)
    loss_sum = fsdp.all_reduce_dp(grads.loss_sum, placement)
    g = grads.params
    foreach_mul_(list(g.values()), 1.0 / num_tokens.clamp(min=1).double())
    grad_norm = tree_global_norm(g)
    updates, opt_state = state.tx.update(g, state.opt_state, state.params)
    apply_updates(state.params, updates)
    new = state.replace(opt_state=opt_state, step=state.step + 1, rng=hf.next_key(state.rng))
    info = {
        "loss": loss_sum / num_tokens.clamp(min=1),
        "grad_norm": grad_norm,
        "num_tokens": num_tokens,
        "lr": current_lr(opt_state),
    }
    return new, info
