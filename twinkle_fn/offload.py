"""Moving a train state's device memory to the host between steps, and back.

``param_offload``, ``grad_offload`` and ``optimizer_offload`` as Megatron users know them: a
trainer that shares its GPU with a rollout engine parks the parameters, the persistent gradient
buffers (megatron's DDP ``main_grad`` buffers) and the optimizer's tensors on the host while the
engine runs, then brings them back::

    parked = tf.offload(state, params=True, grads=True, optimizer=True)   # donates `state`
    ...                                                                 # the GPU is free
    state = tf.reload(parked)                                           # donates `parked`

The move is done on *storages*, not tensors: each storage's bytes are copied to (pinned) host
memory and the storage is resized to zero bytes, so every view of it -- the module's parameters,
megatron's flat parameter and gradient buffers, FSDP2's shards, the optimizer's references --
stays the same Python object and sees its values again after `reload`, with no module surgery.
Storages shared by several tensors move once. On a machine without a GPU the same thing happens
between two host buffers; it frees nothing there but runs the very code path a GPU uses.

`offload` donates the state (a later use raises `DonatedError` naming `tf.offload`), so a state
whose memory is parked cannot be trained on by mistake; `reload` donates the `Offloaded` and
returns a live state. The step counter and RNG key are host tensors and never move.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import optree
import torch
from torch.distributed.tensor import DTensor

from twinkle_fn import backends
from twinkle_fn.pytree import NAMESPACE
from twinkle_fn.state import TrainState, _Donatable, _Donation

KINDS = ("params", "grads", "optimizer")


@dataclasses.dataclass(frozen=True, eq=False)
class _Parked:
    """One storage moved to the host: the storage (now of 0 bytes) and its saved bytes."""

    storage: torch.UntypedStorage
    host: torch.Tensor  # [nbytes] uint8, pinned when the storage is on a GPU
    device: torch.device


@dataclasses.dataclass(frozen=True, eq=False)
class Offloaded(_Donatable):
    """A train state whose ``kinds`` of device memory are on the host (see `offload`).

    ``nbytes``: the bytes moved. Pass it to `reload` to get a live `TrainState` back.
    """

    state: TrainState
    kinds: tuple[str, ...]
    parked: tuple[_Parked, ...] = dataclasses.field(repr=False)
    _donation: _Donation = dataclasses.field(default_factory=_Donation, repr=False, compare=False)
    _LEAVES = ("state",)

    @property
    def nbytes(self) -> int:
        """Bytes moved to the host."""
        return sum(p.host.numel() for p in object.__getattribute__(self, "parked"))


def offload(
    state: TrainState, *, params: bool = True, grads: bool = True, optimizer: bool = True
) -> Offloaded:
    """Move the chosen parts of `state`'s memory to the host; donates `state`.

    `params`: the trainable parameters' storages (for megatron, its flat parameter buffers);
    `grads`: the gradient buffers that outlive a step (megatron's ``main_grad`` buffers; FSDP's
    ``.grad`` tensors if any are held); `optimizer`: every tensor of ``state.opt_state``
    (moments, fp32 master copies). Raises ``ValueError`` when nothing is chosen and
    `DonatedError` for a donated state.
    """
    kinds = tuple(k for k, on in zip(KINDS, (params, grads, optimizer), strict=True) if on)
    if not kinds:
        raise ValueError("offload needs at least one of params, grads or optimizer set to True")
    backends.get(state.model.backend).settle(state.model)  # nothing in flight into what moves
    tensors = {"params": _params, "grads": _grads, "optimizer": _optimizer}
    storages = _unique_storages(t for kind in kinds for t in tensors[kind](state))
    parked = tuple(_park(s) for s in storages)
    _synchronize(parked)
    for p in parked:
        p.storage.resize_(0)
    live = state.replace()
    state.donate("tf.offload")
    return Offloaded(live, kinds, parked)


def reload(offloaded: Offloaded) -> TrainState:
    """Bring an `offload`-ed state's memory back to its devices; donates `offloaded`.

    Returns the live `TrainState` (the same parameter objects, bit-identical values).
    """
    state = offloaded.state
    parked = object.__getattribute__(offloaded, "parked")
    for p in parked:
        p.storage.resize_(p.host.numel())
        _bytes_of(p.storage, p.device).copy_(p.host, non_blocking=True)
    _synchronize(parked)
    offloaded.donate("tf.reload")
    return state


def _params(state: TrainState) -> Iterator[torch.Tensor]:
    yield from (_local(p) for p in state.params.values())


def _grads(state: TrainState) -> Iterator[torch.Tensor]:
    for p in state.params.values():
        for grad in (getattr(p, "main_grad", None), p.grad):
            if isinstance(grad, torch.Tensor):
                yield _local(grad)


def _optimizer(state: TrainState) -> Iterator[torch.Tensor]:
    leaves = optree.tree_leaves(state.opt_state, namespace=NAMESPACE)
    yield from (_local(t) for t in leaves if isinstance(t, torch.Tensor))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """Each distinct non-empty storage once (views of one buffer share it)."""
    seen: dict[tuple[str, int], torch.UntypedStorage] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() > 0:
            seen.setdefault((str(t.device), storage.data_ptr()), storage)
    return list(seen.values())


def _park(storage: torch.UntypedStorage) -> _Parked:
    device = storage.device
    host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=device.type == "cuda")
    host.copy_(_bytes_of(storage, device), non_blocking=True)
    return _Parked(storage, host, device)


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A ``[nbytes]`` uint8 tensor over `storage` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _synchronize(parked: tuple[_Parked, ...]) -> None:
    """Wait for the non-blocking copies before a storage is freed or read."""
    for device in {p.device for p in parked if p.device.type == "cuda"}:
        torch.cuda.synchronize(device)
