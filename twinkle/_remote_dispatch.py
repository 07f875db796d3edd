"""How a remote call's arguments are split over ranks and its results combined.

Upstream Twinkle's ``@remote_function(dispatch=..., collect=...)`` policies as pure functions of
the arguments, the per-rank results and the `DeviceMesh`, so the Ray engine only moves data:

- dispatch ``'all'``: every rank gets the call's arguments; ``'slice'``: each list argument is
  split into contiguous parts, one per rank (other arguments are repeated); ``'slice_dp'``: lists,
  tensors and arrays (along dim 0), also inside dicts, are split by *data* rank with
  `DeviceMesh.get_slice`, so the tp/pp/cp peers of a data rank get the same part; a callable is
  called as ``fn(n, i, args, kwargs, device_mesh)`` for each rank ``i`` of ``n`` and returns that
  rank's ``(args, kwargs)``.
- collect ``'none'``: the per-rank results (one result unwrapped); ``'first'``: rank 0's;
  ``'last_pp'``: those of the last pipeline stage (``'last_pp_first'``: the first of them);
  ``'flatten'``: the results of one rank per data rank, concatenated; ``'mean'``/``'sum'``: the
  mean/sum over the ranks; a callable gets the list of results. Dict results (a `ModelOutput`)
  under ``'flatten'``/``'mean'``/``'sum'`` are merged key by key as upstream's
  ``collect_tensor_dict``: tensors padded and concatenated, lists concatenated, numbers averaged
  (summed under ``'sum'``; ``num_tokens`` is always summed). Tuple results are collected
  element by element.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from numbers import Number
from typing import Any

import numpy as np
import torch

from twinkle.device_mesh import DeviceMesh

Call = tuple[tuple[Any, ...], dict[str, Any]]
PAD_VALUE = 0.0  # what padded positions hold in a local ModelOutput's logps


def dispatch_args(
    dispatch: str | Callable[..., Any],
    world: int,
    mesh: DeviceMesh,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> list[Call]:
    """The ``(args, kwargs)`` of each of `world` ranks under policy `dispatch`.

    Raises ``ValueError`` for an unknown policy, for ``'slice_dp'`` when `mesh` does not have
    `world` ranks or a batch is smaller than its data ranks, and for a callable that does not
    return an ``(args, kwargs)`` pair.
    """
    if callable(dispatch):
        calls = [dispatch(world, i, tuple(args), dict(kwargs), mesh) for i in range(world)]
        for call in calls:
            if not (isinstance(call, tuple) and len(call) == 2 and isinstance(call[1], Mapping)):
                raise ValueError(f"a dispatch function must return (args, kwargs), got {call!r}")
        return [(tuple(a), dict(k)) for a, k in calls]
    if dispatch == "all":
        return [(tuple(args), dict(kwargs)) for _ in range(world)]
    if dispatch == "slice":
        return [
            _map_args(args, kwargs, lambda v, i=i: _split_list(v, world, i)) for i in range(world)
        ]
    if dispatch == "slice_dp":
        if mesh.world_size != world:
            raise ValueError(
                f"dispatch='slice_dp' over {world} ranks needs a mesh of {world} ranks, got "
                f"{mesh}; construct the object with a matching device_mesh"
            )
        calls = []
        for i in range(world):
            data_rank = mesh.get_data_rank_from_global_rank(i)
            calls.append(_map_args(args, kwargs, lambda v, d=data_rank: _slice_batch(v, mesh, d)))
        return calls
    raise ValueError(f"unknown dispatch {dispatch!r}; use all, slice, slice_dp or a callable")


def collect_results(
    collect: str | Callable[..., Any],
    results: Sequence[Any],
    ranks: Sequence[int],
    mesh: DeviceMesh,
) -> Any:
    """The call's result from the `results` of global `ranks` (same order) under `collect`.

    Raises ``ValueError`` for an unknown policy.
    """
    if callable(collect):
        return collect(list(results))
    if not results:
        return list(results)
    if isinstance(results[0], tuple):
        return tuple(
            collect_results(collect, [r[i] for r in results], ranks, mesh)
            for i in range(len(results[0]))
        )
    if collect == "none":
        return results[0] if len(results) == 1 else list(results)
    if collect == "first":
        return results[0]
    if collect in ("last_pp", "last_pp_first"):
        last = set(mesh.get_pp_last_ranks())
        kept = [r for rank, r in zip(ranks, results, strict=True) if rank in last]
        return kept[0] if collect == "last_pp_first" else kept
    if collect not in ("flatten", "mean", "sum"):
        raise ValueError(f"unknown collect {collect!r}")
    if all(r is None for r in results):
        return None
    if isinstance(results[0], Mapping) or collect == "flatten":
        results = _one_per_data_rank(results, ranks, mesh)
    if isinstance(results[0], Mapping):
        return _merge_dicts(results, collect)
    if collect == "flatten":
        return _concat(results)
    return _reduce_numbers(results, collect)


def _map_args(args: Sequence[Any], kwargs: Mapping[str, Any], fn: Callable[[Any], Any]) -> Call:
    return tuple(fn(a) for a in args), {k: fn(v) for k, v in kwargs.items()}


def _split_list(value: Any, parts: int, index: int) -> Any:
    """Part `index` of `parts` contiguous parts of a list (upstream: lists only); else `value`."""
    if not isinstance(value, list):
        return value
    size, extra = divmod(len(value), parts)
    start = index * size + min(index, extra)
    return value[start : start + size + (index < extra)]


def _slice_batch(value: Any, mesh: DeviceMesh, data_rank: int) -> Any:
    """Data rank `data_rank`'s part of a batch-like `value` (lists, tensors/arrays along dim 0,
    dicts of those); anything else is repeated."""
    if isinstance(value, list) or (isinstance(value, torch.Tensor | np.ndarray) and value.ndim):
        return value[mesh.get_slice(len(value), data_rank)]
    if isinstance(value, Mapping):
        sliced = {k: _slice_batch(v, mesh, data_rank) for k, v in value.items()}
        return type(value)(sliced) if isinstance(value, dict) else sliced
    return value


def _one_per_data_rank(results: Sequence[Any], ranks: Sequence[int], mesh: DeviceMesh) -> list:
    """The results of upstream's collect ranks (one per data rank) when every rank answered."""
    if len(results) != mesh.world_size:
        return list(results)
    keep = set(mesh.get_collect_ranks())
    return [r for rank, r in zip(ranks, results, strict=True) if rank in keep]


def _is_number(value: Any) -> bool:
    if isinstance(value, torch.Tensor | np.ndarray):
        return value.ndim == 0
    return isinstance(value, Number) and not isinstance(value, bool)


def _reduce_numbers(values: Sequence[Any], collect: str) -> Any:
    if isinstance(values[0], torch.Tensor):
        stacked = torch.stack(list(values))
        return stacked.sum(0) if collect == "sum" else stacked.mean(0)
    total = np.sum(values, axis=0) if collect == "sum" else np.mean(values, axis=0)
    return total.item() if isinstance(total, np.generic) else total


def _concat(values: Sequence[Any]) -> Any:
    """Lists/tuples chained; tensors padded to a common shape and concatenated along dim 0."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        return _pad_cat([v if v.ndim else v.reshape(1) for v in values])
    if isinstance(first, np.ndarray):
        return np.concatenate([np.atleast_1d(v) for v in values])
    if isinstance(first, list | tuple):
        return type(first)(item for v in values for item in v)
    return list(values)


def _pad_cat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate along dim 0 after right-padding every other dim to the largest size."""
    shape = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].ndim)]
    padded = []
    for t in tensors:
        pad = [p for d in reversed(range(1, t.ndim)) for p in (0, shape[d - 1] - t.shape[d])]
        padded.append(torch.nn.functional.pad(t, pad, value=PAD_VALUE) if any(pad) else t)
    return torch.cat(padded, dim=0)


def _merge_dicts(results: Sequence[Mapping[str, Any]], collect: str) -> Mapping[str, Any]:
    """Upstream's ``collect_tensor_dict``: each key's values merged across the results."""
    merged: dict[str, Any] = {}
    for key in dict.fromkeys(k for r in results for k in r):
        values = [r[key] for r in results if key in r and r[key] is not None]
        if not values:
            merged[key] = None
        elif isinstance(values[0], Mapping):
            merged[key] = _merge_dicts(values, collect)
        elif _is_number(values[0]):
            merged[key] = _reduce_numbers(values, "sum" if key == "num_tokens" else collect)
        elif isinstance(values[0], torch.Tensor | np.ndarray | list | tuple):
            merged[key] = _concat(values)
        else:
            merged[key] = values
    first = results[0]
    return type(first)(merged) if isinstance(first, dict) else merged
