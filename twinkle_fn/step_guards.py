"""What `twinkle_fn.api.step` checks before it updates or donates anything: that the grads are a
live `Grads` of the state's parameters (`check_grads`), that the schedule gives a valid learning
rate for the coming update (`check_next_lr`), and the optional divergence guard
(``on_nonfinite``: `nonfinite_guard`, `NonFiniteError`), which refuses or skips a step whose
loss or gradient norm is NaN or infinite.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from twinkle_fn import backends
from twinkle_fn.distributed import world_size
from twinkle_fn.optim import current_lr
from twinkle_fn.state import Grads, TrainState


class NonFiniteError(FloatingPointError):
    """Raised by `step` when the loss or the gradient norm is NaN or infinite (the state and
    the grads it was given are left usable: nothing was updated)."""


ON_NONFINITE = (None, "raise", "skip")


def check_grads(state: TrainState, grads: Any) -> None:
    """Raise before anything is donated unless `grads` is a live `Grads` shaped like `state`'s
    parameters: ``TypeError`` for another object (e.g. None: no `fwd_bwd` ran), ``ValueError``
    naming the missing or extra parameter, or the first tensor of another shape."""
    if not isinstance(grads, Grads):
        raise TypeError(
            f"tf.step: grads must be the Grads returned by tf.fwd_bwd, got "
            f"{type(grads).__name__}; run tf.fwd_bwd(state, batch) on at least one micro-batch "
            "before stepping"
        )
    grads.check_alive()
    missing = sorted(set(state.params) - set(grads.params))
    extra = sorted(set(grads.params) - set(state.params))
    if missing or extra:
        raise ValueError(
            f"tf.step: grads do not match the state's parameters (missing {missing[:3]}, extra "
            f"{extra[:3]}); pass the grads tf.fwd_bwd computed with this state"
        )
    for name, p in state.params.items():
        if tuple(grads.params[name].shape) != tuple(p.shape):
            raise ValueError(
                f"tf.step: grads[{name!r}] has shape {tuple(grads.params[name].shape)}, the "
                f"parameter {tuple(p.shape)}; pass the grads tf.fwd_bwd computed with this state"
            )


def check_next_lr(state: TrainState) -> None:
    """Evaluate the learning rate of the coming update (CPU counters: no device sync), so that
    a schedule giving a non-finite or negative value is refused before anything is donated."""
    next_lr = getattr(state.tx, "next_lr", None)
    if next_lr is None:
        return
    try:
        next_lr(state.opt_state)
    except ValueError as err:
        raise ValueError(
            f"tf.step at step {int(state.step)}: {err}; nothing was updated and the state is "
            "still usable: fix the schedule (it must give a finite lr >= 0 at every step)"
        ) from None


def nonfinite_guard(state: TrainState, grads: Grads, on_nonfinite: str) -> dict[str, Any] | None:
    """None when this step's loss and gradient norm are finite on every rank; else raise
    `NonFiniteError` (``"raise"``) or return the ``info`` of a skipped step (``"skip"``)."""
    backend = backends.get(state.model.backend)
    loss = grads.loss_sum / grads.num_tokens.clamp(min=1)
    norm = backend.grad_norm(state, grads) if backend.offers_grad_norm else torch.tensor(0.0)
    # on the loss's device: NCCL reduces device tensors only
    finite = torch.isfinite(loss).all() & torch.isfinite(norm.to(loss.device)).all()
    finite = finite.to(torch.int32)
    if world_size() > 1:  # every rank must take the same branch: the update is a collective
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    if bool(finite):
        return None
    if on_nonfinite == "raise":
        raise NonFiniteError(
            f"step {int(state.step)}: loss {float(loss)}, gradient norm {float(norm)} (on this "
            "rank) is not finite; nothing was updated and the state is still usable. Lower the "
            "learning rate, check the data, or pass on_nonfinite='skip' to skip such steps"
        )
    lr = current_lr(state.opt_state)
    return {
        "loss": loss,
        "grad_norm": norm,
        "num_tokens": grads.num_tokens,
        "lr": lr,
        "skipped": True,
    }
