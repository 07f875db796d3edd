"""`TrainState` and `Grads`: immutable pytrees with JAX-style donation.

torch.func transforms do not compose with FSDP2, DTensor or megatron-core, so the core updates
buffers in place and exposes that through donation: a function that donates an argument marks it
dead, and any later read of its tensors raises `DonatedError`. ``donate=False`` on the API gives
copy semantics instead (the inputs stay bit-identical).

Both classes are optree nodes: their tensor fields are children, everything else (the module
skeleton, the optimizer transform, the mesh) is static metadata.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optree
import torch

from twinkle_fn.pytree import NAMESPACE, PyTree, clone_leaf

# A 64-bit linear congruential generator advances the state's random key (int64 arithmetic wraps).
LCG_MUL = 6364136223846793005
LCG_INC = 1442695040888963407


def next_key(rng: torch.Tensor) -> torch.Tensor:
    """The random key after `rng` (0-d int64): one step of a 64-bit LCG."""
    return rng * LCG_MUL + LCG_INC


class DonatedError(RuntimeError):
    """Raised when a state or grads object is used after a call donated it."""


class _Donation:
    """A mutable marker shared by nothing else: the one place a dead object is recorded."""

    __slots__ = ("by",)

    def __init__(self) -> None:
        self.by: str | None = None


class _Donatable:
    """Mixin: guards the tensor fields named in `_LEAVES` against use after donation."""

    _LEAVES: tuple[str, ...] = ()

    def __getattribute__(self, name: str) -> Any:
        if name in type(self)._LEAVES:
            object.__getattribute__(self, "check_alive")()
        return object.__getattribute__(self, name)

    @property
    def donated(self) -> bool:
        """Whether a call has consumed this object."""
        return object.__getattribute__(self, "_donation").by is not None

    def check_alive(self) -> None:
        """Raise `DonatedError` if this object was donated."""
        by = object.__getattribute__(self, "_donation").by
        if by is not None:
            raise DonatedError(
                f"this {type(self).__name__} was donated to {by} and its buffers now belong to "
                f"the result; use the value {by} returned, or pass donate=False to keep it"
            )

    def replace(self, **changes: Any) -> Any:
        """A new object with `changes` applied; unnamed fields are shared, not copied."""
        self.check_alive()
        return dataclasses.replace(self, _donation=_Donation(), **changes)

    def donate(self, by: str) -> None:
        """Mark this object consumed by the call named `by`; later reads of it raise."""
        self.check_alive()
        object.__getattribute__(self, "_donation").by = by


@optree.register_pytree_node_class(namespace=NAMESPACE)
@dataclasses.dataclass(frozen=True, eq=False)
class TrainState(_Donatable):
    """Everything a training step reads and writes.

    Children (tensors): ``params`` (trainable parameters, ``dict[name, nn.Parameter]``, the very
    tensors the module computes with), ``opt_state`` (the optimizer transform's state), ``step``
    (0-d int64 on CPU: optimizer updates applied) and ``rng`` (0-d int64 on CPU: the random key
    that seeds dropout for the next step), and ``loss_scale`` (a `LossScale` under float16
    compute, else None). Static: ``model`` (a `twinkle_fn.models.Model`: module
    skeleton, family and backend), ``tx`` (a `GradientTransformation`) and ``mesh``.
    """

    params: dict[str, torch.Tensor]
    opt_state: PyTree
    step: torch.Tensor
    rng: torch.Tensor
    model: Any = dataclasses.field(repr=False)
    tx: Any = dataclasses.field(repr=False)
    mesh: Any = None
    loss_scale: Any = None  # a `LossScale` when computing in float16, else None
    _donation: _Donation = dataclasses.field(default_factory=_Donation, repr=False, compare=False)

    _LEAVES = ("params", "opt_state", "step", "rng", "loss_scale")

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[str, ...]]:
        """optree protocol: tensor children, static metadata, child names."""
        children = (self.params, self.opt_state, self.step, self.rng, self.loss_scale)
        return children, (self.model, self.tx, self.mesh), self._LEAVES

    @classmethod
    def tree_unflatten(cls, meta: tuple[Any, ...], children: tuple[Any, ...]) -> TrainState:
        """optree protocol: rebuild from `tree_flatten`'s output."""
        params, opt_state, step, rng, loss_scale = children
        model, tx, mesh = meta
        return cls(params, opt_state, step, rng, model, tx, mesh, loss_scale)

    def copy(self) -> TrainState:
        """A deep copy of every tensor (parameters stay ``nn.Parameter``s), sharing static metadata."""
        return optree.tree_map(clone_leaf, self, namespace=NAMESPACE)


@optree.register_pytree_node_class(namespace=NAMESPACE)
@dataclasses.dataclass(frozen=True, eq=False)
class Grads(_Donatable):
    """Gradients of a *token sum* of losses, with what is needed to normalise them exactly.

    ``params``: a tree shaped like ``TrainState.params`` holding d(sum of token losses)/d(param),
    summed over every micro-batch accumulated so far. ``loss_sum`` (0-d float32) and
    ``num_tokens`` (0-d int64) are the matching sums of token losses and supervised tokens;
    `step` divides by the global token count once, so k micro-batches equal one batch of all
    their tokens. ``num_micro_batches`` (static) counts the accumulated micro-batches.
    """

    params: dict[str, torch.Tensor]
    loss_sum: torch.Tensor
    num_tokens: torch.Tensor
    num_micro_batches: int = 1
    _donation: _Donation = dataclasses.field(default_factory=_Donation, repr=False, compare=False)

    _LEAVES = ("params", "loss_sum", "num_tokens")

    def tree_flatten(self) -> tuple[tuple[Any, ...], int, tuple[str, ...]]:
        """optree protocol: tensor children, static metadata, child names."""
        return (self.params, self.loss_sum, self.num_tokens), self.num_micro_batches, self._LEAVES

    @classmethod
    def tree_unflatten(cls, meta: int, children: tuple[Any, ...]) -> Grads:
        """optree protocol: rebuild from `tree_flatten`'s output."""
        return cls(*children, num_micro_batches=meta)

    def copy(self) -> Grads:
        """A deep copy of every tensor."""
        return optree.tree_map(clone_leaf, self, namespace=NAMESPACE)
