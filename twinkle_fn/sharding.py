"""Sharding specs as data: which tensor dim splits over which mesh axis, and the pure maths of it.

Splits follow ``torch.chunk`` along the dim, which is what DTensor's ``Shard(dim)`` does: with
``c = ceil(n / parts)``, shard ``i`` holds ``[min(i*c, n), min((i+1)*c, n))``, so the first shards
are full and trailing ones may be smaller or empty. The FSDP/TP backends use the same functions,
so `local_shard` on one process predicts exactly what a rank holds. A parameter's sharding is a
sequence of specs applied in order (e.g. tp, then FSDP's dim-0 split of the tp-local tensor);
`unshard_pieces` inverts a whole sequence from every rank's piece.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch

from twinkle_fn.mesh import COORD_AXES, Mesh


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ShardSpec:
    """Split tensor dim `dim` over mesh axis `axis`; both ``None`` means replicated.

    `axis` is one of `twinkle_fn.mesh.COORD_AXES` ('tp', 'fsdp', 'ep', ...). `dim` may be
    negative (counted from the end, as in torch). Raises ``ValueError`` if only one of the two is
    set, if `dim` is not an int, or if `axis` is not a mesh axis.
    """

    dim: int | None = None
    axis: str | None = None

    def __post_init__(self) -> None:
        if (self.dim is None) != (self.axis is None):
            raise ValueError(
                f"ShardSpec(dim={self.dim!r}, axis={self.axis!r}) sets only one of dim and axis; "
                "set both to shard, or neither to replicate"
            )
        if self.dim is not None and not _is_int(self.dim):
            raise ValueError(f"ShardSpec dim must be an int, got {self.dim!r}")
        if self.axis is not None and self.axis not in COORD_AXES:
            raise ValueError(
                f"ShardSpec axis {self.axis!r} is not a mesh axis; use one of {', '.join(COORD_AXES)}"
            )

    @property
    def replicated(self) -> bool:
        """Whether every rank holds the whole tensor."""
        return self.axis is None


ShardPlan = Mapping[str, ShardSpec]


def _check_split(n: int, parts: int) -> None:
    if not _is_int(n) or n < 0:
        raise ValueError(f"shard length n must be an int >= 0, got {n!r}")
    if not _is_int(parts) or parts < 1:
        raise ValueError(f"shard parts must be an int >= 1, got {parts!r}")


def shard_sizes(n: int, parts: int) -> list[int]:
    """Sizes of the `parts` shards of a length-`n` dim, as ``torch.chunk`` (empty shards kept).

    Raises ``ValueError`` if `n` < 0 or `parts` < 1.
    """
    _check_split(n, parts)
    ranges = [shard_range(n, parts, i) for i in range(parts)]
    return [end - start for start, end in ranges]


def shard_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """Half-open ``[start, end)`` of shard `index` of a length-`n` dim split into `parts`.

    Raises ``ValueError`` if `n` < 0, `parts` < 1 or `index` is outside ``[0, parts)``.
    """
    _check_split(n, parts)
    if not _is_int(index) or not 0 <= index < parts:
        raise ValueError(f"shard index {index!r} is out of range; use 0 <= index < {parts}")
    chunk = -(-n // parts)
    start = min(index * chunk, n)
    return start, min(start + chunk, n)


def _normalize_dim(dim: int, shape: torch.Size) -> int:
    ndim = len(shape)
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"ShardSpec dim {dim} is out of range for a tensor of shape {list(shape)}; "
            f"use a dim in [{-ndim}, {ndim})"
        )
    return dim % ndim


def local_shard(
    tensor: torch.Tensor, spec: ShardSpec, coords: Mapping[str, int], mesh: Mesh
) -> torch.Tensor:
    """The part of `tensor` that the rank at `coords` holds under `spec` (a view, no copy).

    `coords` maps mesh axes to this rank's index, e.g. ``{**mesh.coords(r),
    **mesh.expert_coords(r)}``; only ``coords[spec.axis]`` is read. A replicated spec returns
    `tensor` itself. Raises ``ValueError`` if `spec.dim` does not fit the tensor, or if
    `coords` lacks `spec.axis` or holds an index outside ``[0, mesh.sizes[spec.axis])``.
    """
    axis, dim = spec.axis, spec.dim
    if axis is None or dim is None:
        return tensor
    dim = _normalize_dim(dim, tensor.shape)
    parts = mesh.sizes[axis]
    if axis not in coords:
        raise ValueError(
            f"coords {dict(coords)} have no {axis!r} entry; pass the rank's coordinates, "
            "e.g. {**mesh.coords(rank), **mesh.expert_coords(rank)}"
        )
    index = coords[axis]
    if not _is_int(index) or not 0 <= index < parts:
        raise ValueError(
            f"coordinate {axis}={index!r} is out of range for {axis}={parts}; "
            f"use 0 <= {axis} < {parts}"
        )
    start, end = shard_range(tensor.shape[dim], parts, index)
    return tensor.narrow(dim, start, end - start)


def unshard_local(shards: Sequence[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """Rebuild the full tensor from every rank's shard, in axis-index order.

    Sharded: the concatenation along ``spec.dim`` (a new tensor). Replicated: checks that all
    shards are equal and returns the first. Raises ``ValueError`` for no shards, shards whose
    dtype or non-split sizes differ, or replicas that differ.
    """
    if not shards:
        raise ValueError("unshard_local got no shards; pass one tensor per rank of the axis")
    first = shards[0]
    if spec.dim is None:
        for i, s in enumerate(shards[1:], start=1):
            if s.dtype != first.dtype or not torch.equal(s, first):
                raise ValueError(
                    f"replica {i} differs from replica 0 under a replicated spec; "
                    "replicated tensors must be identical on every rank"
                )
        return first
    dim = _normalize_dim(spec.dim, first.shape)

    def others(t: torch.Tensor) -> list[int]:
        return [size for d, size in enumerate(t.shape) if d != dim]

    for i, s in enumerate(shards[1:], start=1):
        if s.dtype != first.dtype:
            raise ValueError(f"shard {i} has dtype {s.dtype} but shard 0 has {first.dtype}")
        if s.dim() != first.dim() or others(s) != others(first):
            raise ValueError(
                f"shard {i} has shape {list(s.shape)} but shard 0 has {list(first.shape)}; "
                f"shards may differ only along dim {dim}"
            )
    return torch.cat(list(shards), dim=dim)


def spec_for(plan: ShardPlan, name: str) -> ShardSpec:
    """The spec of parameter `name` in `plan`; unmatched names are replicated.

    Keys are exact names or ``fnmatch`` patterns ('*' matches any run of characters, dots
    included: ``'model.layers.*.self_attn.q_proj.weight'``). An exact key wins; otherwise every
    matching pattern must give the same spec. Raises ``ValueError`` when matching patterns
    disagree, ``TypeError`` when a plan value is not a `ShardSpec`.
    """
    if name in plan:
        matches = {name: plan[name]}
    else:
        matches = {p: s for p, s in plan.items() if fnmatchcase(name, p)}
    for pattern, spec in matches.items():
        if not isinstance(spec, ShardSpec):
            raise TypeError(f"plan entry {pattern!r} is {spec!r}, not a ShardSpec")
    specs = set(matches.values())
    if len(specs) > 1:
        raise ValueError(
            f"parameter {name!r} matches patterns with different specs: {matches}; make the "
            "patterns disjoint or add an exact entry for it"
        )
    return specs.pop() if specs else ShardSpec()


def unshard_pieces(
    pieces: Mapping[int, torch.Tensor], specs: Sequence[ShardSpec], mesh: Mesh
) -> torch.Tensor:
    """The tensor whose part on each rank, under `specs` applied in order, is ``pieces[rank]``.

    `pieces` maps every rank of `mesh` to its piece (``local_shard`` of each spec in turn at that
    rank's ``{**mesh.coords(r), **mesh.expert_coords(r)}``). The specs are undone last first:
    the pieces of each group of ranks along a spec's axis are joined in axis-index order, and
    ranks that then hold the same part must hold equal tensors (replicas). Returns the piece
    itself when nothing is split and every rank holds it. Raises ``ValueError`` when a rank of
    `mesh` is missing or unknown, when two specs split over the same axis (not invertible from
    pieces), and as `unshard_local` does when pieces do not join or replicas differ.
    """
    world = set(range(mesh.world_size))
    if set(pieces) != world:
        missing, unknown = sorted(world - set(pieces)), sorted(set(pieces) - world)
        raise ValueError(
            f"pieces must hold exactly the ranks 0..{mesh.world_size - 1} of {mesh}; "
            f"missing {missing}, unknown {unknown}"
        )
    axes = [s.axis for s in specs if s.axis is not None]
    if len(axes) != len(set(axes)):
        raise ValueError(
            f"specs {list(specs)} split over one axis twice; each axis may split a tensor once"
        )
    current = dict(pieces)
    for spec in reversed(specs):
        if spec.axis is None:
            continue
        # Members of an axis group differ only in that axis, so rank order is axis-index order.
        for group in mesh.group_ranks(spec.axis):
            whole = unshard_local([current[r] for r in group], spec)
            current.update(dict.fromkeys(group, whole))
    return unshard_local([current[r] for r in sorted(current)], ShardSpec())
