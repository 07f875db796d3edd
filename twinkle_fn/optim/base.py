"""The optax-style optimizer interface: gradient transformations that work in place.

A `GradientTransformation` is a pair of functions. ``init(params)`` builds the optimizer state;
``update(updates, state, params)`` turns gradients into parameter updates and returns
``(updates, new_state)``. Both trees are *donated*: the update is computed into the buffers of
`updates` and the state's tensors are advanced in place, so a step allocates no parameter-sized
memory beyond the kernels' temporaries. ``apply_updates(params, updates)`` then adds the updates to
the parameters in place.

A caller may hand ``update`` a `ScaledUpdates` instead (the gradients and a factor not yet
multiplied in) when the transformation says it takes one (``takes_scaled``): a transformation
that reads every element anyway then folds the factor into that pass (AdamW's kernel), and one
that only needs the factor's effect on a norm (clipping) adjusts the factor alone, so neither the
token normalisation nor the clipping pays a pass over the gradients of its own.

States are pytrees whose leaves are tensors (NamedTuples of tensors and trees of tensors), so a
train state that holds them can be flattened, sharded and checkpointed like the parameters.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from twinkle_fn.pytree import PyTree, tree_global_norm, tree_leaves, tree_structure

Params = PyTree
Updates = PyTree
OptState = PyTree
Schedule = Callable[[int], float]


class GradientTransformation(NamedTuple):
    """An optimizer as two functions: ``init(params) -> state`` and
    ``update(updates, state, params) -> (updates, state)`` (both arguments donated), and
    optionally ``next_lr(state)``: the learning rate the next ``update`` will use (a float, read
    from CPU counters: no device sync), raising ``ValueError`` when a schedule gives a bad value,
    so that a caller can refuse an update before it donates anything (None: no learning rate);
    and ``takes_scaled``: whether ``update`` also takes a `ScaledUpdates` (else callers
    `materialise` a pending scale first). An ``update`` that takes one may return one."""

    init: Callable[[Params], OptState]
    update: Callable[[Updates, OptState, Params], tuple[Updates, OptState]]
    next_lr: Callable[[OptState], float | None] | None = None
    takes_scaled: bool = False


@dataclasses.dataclass(frozen=True)
class ScaledUpdates:
    """Updates whose value is every leaf of `tree` times the 0-d device tensor `scale`, which is
    not multiplied in yet. `norm`: the global norm of `tree` itself (not of the scaled value)
    when the caller has measured it, else None; a transformation that changes the tree in place
    drops it. Not a pytree node: only a transformation whose ``takes_scaled`` is True receives
    one."""

    tree: Updates
    scale: torch.Tensor
    norm: torch.Tensor | None = None


def pending_scale(tree: Updates, scale: torch.Tensor) -> tuple[ScaledUpdates, torch.Tensor]:
    """`tree` with the 0-d `scale` pending (a `ScaledUpdates` carrying the tree's global norm,
    measured here once) and the global norm of the scaled value (in the tree norm's dtype), with
    no pass over the tree but the norm's read and no host sync."""
    norm = tree_global_norm(tree)
    return ScaledUpdates(tree, scale, norm), (norm * scale).to(norm.dtype)


def materialise(updates: Updates | ScaledUpdates) -> Updates:
    """`updates` as a plain tree: a `ScaledUpdates`' tree multiplied in place by its scale
    (`foreach_mul_`, no host sync), anything else as it is."""
    if not isinstance(updates, ScaledUpdates):
        return updates
    foreach_mul_(tensor_leaves_like(updates.tree, updates.tree, "updates"), updates.scale)
    return updates.tree


class EmptyState(NamedTuple):
    """The state of a stateless transformation: a pytree with no leaves."""


def chain(*txs: GradientTransformation) -> GradientTransformation:
    """Compose transformations left to right: ``chain(clip, adamw)`` clips, then runs AdamW.

    The state is a tuple holding one state per transformation, in the same order. The chain takes
    a `ScaledUpdates` when its first member does; a pending scale is passed on to each member
    that takes one and multiplied in before one that does not, and the chain returns plain
    updates. Raises ``TypeError`` if an argument is not a `GradientTransformation`, and (from
    ``update``) ``ValueError`` if the state tuple has the wrong length.
    """
    for i, tx in enumerate(txs):
        if not isinstance(tx, GradientTransformation):
            raise TypeError(
                f"chain: argument {i} is a {type(tx).__name__}, expected a GradientTransformation"
            )

    def init(params: Params) -> tuple[OptState, ...]:
        return tuple(tx.init(params) for tx in txs)

    def update(
        updates: Updates, state: tuple[OptState, ...], params: Params = None
    ) -> tuple[Updates, tuple[OptState, ...]]:
        if not isinstance(state, tuple) or len(state) != len(txs):
            raise ValueError(
                f"chain: state must be a tuple of {len(txs)} states (one per transformation), "
                f"got {type(state).__name__}; build it with the chain's own init"
            )
        new_states = []
        for tx, s in zip(txs, state, strict=True):
            updates, s = tx.update(updates if tx.takes_scaled else materialise(updates), s, params)
            new_states.append(s)
        return materialise(updates), tuple(new_states)

    def next_lr(state: tuple[OptState, ...]) -> float | None:
        # every scheduled member is evaluated: any of them may refuse the next update
        lrs = [tx.next_lr(s) for tx, s in zip(txs, state, strict=True) if tx.next_lr is not None]
        return lrs[0] if lrs else None

    return GradientTransformation(init, update, next_lr, bool(txs) and txs[0].takes_scaled)


def apply_updates(params: Params, updates: Updates) -> Params:
    """Add `updates` to `params` in place (``torch._foreach_add_`` under ``no_grad``).

    Returns `params` itself, whose tensors now hold the new values. Raises ``ValueError`` if the
    two trees have different structures.
    """
    p, u = local_operands(
        tensor_leaves_like(params, params, "params"),
        tensor_leaves_like(updates, params, "updates"),
    )
    with torch.no_grad():
        for idx in foreach_groups(p):
            torch._foreach_add_([p[i] for i in idx], [u[i] for i in idx])
    return params


def local_operands(*columns: Sequence[torch.Tensor | None]) -> list[list[torch.Tensor | None]]:
    """`columns` (equal-length lists: leaf i of each is one elementwise op's operands) with each
    leaf's DTensors replaced by their local shards wherever that gives the same result.

    Elementwise math commutes with a sharding when every operand of the leaf is a DTensor on the
    same mesh with the same placements, none of them Partial (a partial sum must be reduced
    before it is squared or divided). Such leaves come back as plain tensors (views of the same
    storage, so in-place ops update the DTensors), and the ``_foreach`` kernels then run on them
    without DTensor's per-op, per-tensor dispatch, which dominated the host time of an FSDP2
    step. Any other leaf (a Partial gradient, mixed placements) keeps its DTensors. ``None``
    entries (an operand a leaf does not have) are passed through and ignored. Raises
    ``ValueError`` if the columns differ in length.
    """
    if len({len(c) for c in columns}) > 1:
        raise ValueError(f"local_operands: columns differ in length: {[len(c) for c in columns]}")
    out = [list(c) for c in columns]
    # no_grad: the shard itself, not an autograd view of it that in-place ops would reject
    with torch.no_grad():
        for i, leaf in enumerate(zip(*columns, strict=True)):
            operands = [t for t in leaf if t is not None]
            if not operands or not isinstance(operands[0], DTensor):
                continue
            spec = (operands[0].device_mesh, operands[0].placements)
            if any(p.is_partial() for p in spec[1]) or not all(
                isinstance(t, DTensor) and (t.device_mesh, t.placements) == spec for t in operands
            ):
                continue
            for column in out:
                if column[i] is not None:
                    column[i] = column[i].to_local()
    return out


def current_lr(opt_state: OptState) -> float | None:
    """The learning rate that the *last* update used, for logging.

    Searches `opt_state` (a state, or the tuple of states of a `chain`, nested to any depth) for
    the first state with 0-d tensor fields ``count`` and ``lr`` (`AdamWState`, `SGDState`).
    Returns ``None`` if there is none, or if it has applied no update yet. Reads CPU tensors only:
    no device sync.
    """
    found = _scheduled_state(opt_state)
    if found is None or int(found.count) == 0:
        return None
    return float(found.lr)


def _scheduled_state(opt_state: OptState) -> Any:
    """The first state in `opt_state` (depth first) with 0-d tensor ``count`` and ``lr``."""
    fields = (getattr(opt_state, "count", None), getattr(opt_state, "lr", None))
    if all(isinstance(f, torch.Tensor) and f.dim() == 0 for f in fields):
        return opt_state
    if isinstance(opt_state, tuple | list):
        for sub in opt_state:
            if (found := _scheduled_state(sub)) is not None:
                return found
    return None


def tensor_leaves_like(tree: PyTree, reference: PyTree, name: str) -> list[torch.Tensor]:
    """The leaves of `tree`, after checking that it has `reference`'s structure and that every
    leaf is a tensor. Raises ``ValueError`` naming `name` otherwise."""
    if tree is not reference and tree_structure(tree) != tree_structure(reference):
        raise ValueError(
            f"{name} must have the structure of the parameters it belongs to: "
            f"got {tree_structure(tree)}, expected {tree_structure(reference)}"
        )
    leaves = tree_leaves(tree)
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            raise ValueError(f"{name}: leaf {i} is a {type(leaf).__name__}, expected a Tensor")
    return leaves


def foreach_groups(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of `tensors` grouped by (type, device mesh, device, dtype), each in input order.

    ``torch._foreach_*`` kernels run as one fused launch only over tensors that share a device and
    a dtype (mixed lists silently fall back to a per-tensor loop), and a list may not mix
    DTensors of different meshes with each other or with plain tensors.
    """
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, t in enumerate(tensors):
        key = (type(t), getattr(t, "device_mesh", None), t.device, t.dtype)
        groups.setdefault(key, []).append(i)
    return list(groups.values())


@torch.no_grad()
def foreach_mul_(tensors: Sequence[torch.Tensor], scale: torch.Tensor) -> None:
    """Multiply every tensor in place by the 0-d tensor `scale`, with no host sync.

    Sharded tensors (DTensors) are scaled through their local shards: scaling is elementwise, so
    it commutes with any placement, and DTensor rejects a plain-tensor operand.
    """
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    for idx in foreach_groups(local):
        group = [local[i] for i in idx]
        torch._foreach_mul_(group, scale.to(device=group[0].device, dtype=group[0].dtype))


def check_nonnegative(name: str, value: Any, *, below_one: bool = False) -> float:
    """`value` as a float, after checking it is a finite real number >= 0 (and < 1 if
    `below_one`). Raises ``ValueError`` naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value) or value < 0.0 or (below_one and value >= 1.0):
        bound = "in [0, 1)" if below_one else "finite and >= 0"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return value


def check_lr(lr: float | Schedule) -> float | Schedule:
    """`lr` as given if it is a schedule (a callable), else as a float checked to be finite and
    > 0: a constant lr of 0 would train nothing. Raises ``ValueError`` for anything else (e.g.
    0, or the string ``"1e-3"``)."""
    if callable(lr):
        return lr
    return check_positive_lr("lr", lr)


def check_positive_lr(name: str, lr: Any) -> float:
    """`lr` as a float, checked to be a finite real number > 0. Raises ``ValueError`` naming
    `name`, the value and the fix otherwise (a schedule may still pass through 0 on its way,
    e.g. at the start of a warmup: only its constant or peak value is checked here)."""
    lr = check_nonnegative(name, lr)
    if lr == 0.0:
        raise ValueError(
            f"{name} must be > 0, got 0.0: a learning rate of 0 never changes the weights; pass "
            "a positive value (to evaluate without training, run forward passes only)"
        )
    return lr


def init_counter() -> tuple[torch.Tensor, torch.Tensor]:
    """``(count, lr)`` for a fresh scheduled state, both 0-d CPU tensors: count (int64) is the
    number of updates applied, 0; lr (float64) is the lr of the last update, 0 before the first
    (not NaN, so that states compare equal with ``torch.equal``).

    They live on the CPU so that evaluating the schedule and logging the lr need no device sync.
    """
    return torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.float64)


def lr_at(lr: float | Schedule, count: torch.Tensor) -> float:
    """The lr for the update about to run: `lr` itself, or the schedule at `count` (the number of
    updates already applied). Raises ``ValueError`` if a schedule returns a non-finite or negative
    value."""
    if not callable(lr):
        return lr
    value = lr(operator.index(count))
    try:
        return check_nonnegative("lr", value)
    except ValueError as err:
        raise ValueError(
            f"the lr schedule returned a bad value at step {int(count)}: {err}"
        ) from None


def advance_counter(count: torch.Tensor, lr_tensor: torch.Tensor, lr: float) -> None:
    """Record one applied update with learning rate `lr`, in place."""
    count.add_(1)
    lr_tensor.fill_(lr)
