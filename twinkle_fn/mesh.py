"""A pure description of the device mesh: sizes, rank <-> coordinate maps and group membership.

Nothing here touches torch.distributed, so every map can be property-tested in one process.

Dense layout (attention, MLP, embeddings): Megatron's ``order='tp-cp-ep-dp-pp'`` with our data
parallelism split into ``fsdp`` (shards) inside ``dp`` (replicas), and the transformers backend's
Ulysses sequence parallelism (``ulysses``) next to ``cp``, i.e. ``tp-cp-ulysses-fsdp-dp-pp``,
tp fastest::

    rank = tp + T*(cp + C*(ulysses + U*(fsdp + F*(dp + D*pp))))

so Megatron's data-parallel index is ``dp * fsdp_size + fsdp`` (upstream Twinkle's ``data_rank``).

Expert layout (MoE expert weights): megatron-core's expert ``RankGenerator`` over the same world,
``etp-ep-edp-pp``, with ``edp = world // (etp * ep * pp)``. The pipeline groups of both layouts
are the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DENSE_AXES = ("tp", "cp", "ulysses", "fsdp", "dp", "pp")
EXPERT_AXES = ("etp", "ep", "edp", "pp")
# Composite names accepted by `Mesh.group_ranks`; each is a group over several dense axes.
COMPOSITE_AXES = (("dp_total", ("fsdp", "dp")), ("mp", ("tp", "pp")))
# Every name `Mesh.groups_of` reports, in a fixed order.
GROUP_NAMES = ("tp", "cp", "ulysses", "fsdp", "dp", "pp", "dp_total", "mp", "etp", "ep", "edp")
# Axes with a size and a per-rank coordinate (what a `ShardSpec` may split over).
COORD_AXES = ("tp", "cp", "ulysses", "fsdp", "dp", "pp", "etp", "ep", "edp")

_SIZE_FIELDS = ("dp", "fsdp", "tp", "pp", "cp", "ep", "etp", "ulysses")
_WORLD_FIELDS = ("dp", "fsdp", "tp", "pp", "cp", "ulysses")

_Layout = tuple[tuple[str, int], ...]


def _check_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"mesh {name} must be a positive int, got {value!r}; use {name}=1 or more")
    return value


def _decompose(layout: _Layout, rank: int) -> dict[str, int]:
    coords = {}
    for name, size in layout:
        rank, coords[name] = divmod(rank, size)
    return coords


def _compose(layout: _Layout, coords: dict[str, int]) -> int:
    rank, stride = 0, 1
    for name, size in layout:
        rank += coords[name] * stride
        stride *= size
    return rank


def _group_of(layout: _Layout, rank: int, axes: frozenset[str]) -> list[int]:
    base = _decompose(layout, rank)
    for name in axes:
        base[name] = 0
    members, stride = [_compose(layout, base)], 1
    for name, size in layout:
        if name in axes:
            members = [m + i * stride for i in range(size) for m in members]
        stride *= size
    return sorted(members)


@dataclass(frozen=True)
class Mesh:
    """Sizes of every parallel axis; all rank math is pure.

    ``dp`` and ``fsdp`` split the data. ``dp`` keeps whole parameters for compute and shards
    the optimizer state over the data ranks (megatron's distributed optimizer; ZeRO-2 on the
    transformers backend); ``fsdp`` also shards the parameters between uses. With both > 1,
    the state is sharded over ``fsdp`` and replicated over ``dp`` (HSDP). ``tp``, ``pp``, ``cp`` are
    tensor, pipeline and context parallelism; ``ep``/``etp`` are expert and expert-tensor
    parallelism, laid over the same world; ``sequence_parallel`` is Megatron's SP (needs tp > 1).
    ``ulysses`` is DeepSpeed-Ulysses sequence parallelism (transformers backend): its ranks share
    one data shard (like cp) and split each sequence, trading heads for sequence in attention.

    Raises ``ValueError`` for a size that is not a positive int, ``sequence_parallel`` with
    ``tp == 1``, or ``etp * ep`` not dividing ``tp * cp * fsdp * dp``.
    """

    dp: int = 1
    fsdp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    sequence_parallel: bool = False
    ulysses: int = 1

    def __post_init__(self) -> None:
        for name in _SIZE_FIELDS:
            _check_size(name, getattr(self, name))
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(
                f"mesh sequence_parallel must be a bool, got {self.sequence_parallel!r}; "
                "use True or False"
            )
        if self.sequence_parallel and self.tp == 1:
            raise ValueError(
                "mesh sequence_parallel=True needs tp > 1 (it splits activations over the "
                "tensor-parallel group); set tp > 1 or sequence_parallel=False"
            )
        non_pp = self.tp * self.cp * self.ulysses * self.fsdp * self.dp
        if non_pp % (self.etp * self.ep):
            raise ValueError(
                f"mesh etp={self.etp} x ep={self.ep} = {self.etp * self.ep} must divide "
                f"tp x cp x ulysses x fsdp x dp = {non_pp} (the ranks of one pipeline stage); "
                "choose ep "
                f"and etp whose product divides {non_pp}"
            )

    @staticmethod
    def from_world(world_size: int, **sizes: int | bool) -> Mesh:
        """The mesh with the given sizes and ``dp`` chosen so the mesh covers `world_size` ranks.

        Raises ``ValueError`` if `dp` is given, if a size is invalid, or if the product of the
        other sizes does not divide `world_size`.
        """
        _check_size("world_size", world_size)
        if "dp" in sizes:
            raise ValueError("Mesh.from_world fills dp itself; pass the other sizes only")
        given = {k: _check_size(k, v) for k, v in sizes.items() if k in _WORLD_FIELDS}
        used = math.prod(given.values())
        if world_size % used:
            desc = " x ".join(f"{k}={v}" for k, v in given.items())
            raise ValueError(
                f"a world of {world_size} ranks cannot hold {desc} = {used} ranks per replica; "
                f"choose sizes whose product divides {world_size}"
            )
        return Mesh(dp=world_size // used, **sizes)  # type: ignore[arg-type]

    @property
    def world_size(self) -> int:
        """Number of ranks: ``tp * cp * ulysses * fsdp * dp * pp`` (ep and etp reuse them)."""
        return self.tp * self.cp * self.ulysses * self.fsdp * self.dp * self.pp

    @property
    def edp(self) -> int:
        """Expert data-parallel size: ``world_size // (etp * ep * pp)``."""
        return self.world_size // (self.etp * self.ep * self.pp)

    @property
    def data_world_size(self) -> int:
        """Number of distinct data shards: ``dp * fsdp``."""
        return self.dp * self.fsdp

    @property
    def sizes(self) -> dict[str, int]:
        """Size of every axis that has a per-rank coordinate (`COORD_AXES`)."""
        return {name: getattr(self, name) for name in COORD_AXES}

    def _dense(self) -> _Layout:
        return tuple((name, getattr(self, name)) for name in DENSE_AXES)

    def _expert(self) -> _Layout:
        return tuple((name, getattr(self, name)) for name in EXPERT_AXES)

    def _check_rank(self, rank: int) -> int:
        world = self.world_size
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
            raise ValueError(
                f"rank {rank!r} is out of range for a mesh of {world} ranks; "
                f"use an int with 0 <= rank < {world}"
            )
        return rank

    def validate(self, world_size: int) -> None:
        """Check that the mesh covers exactly `world_size` ranks; raises ``ValueError`` if not."""
        if self.world_size == world_size:
            return
        desc = " x ".join(f"{k}={getattr(self, k)}" for k in _WORLD_FIELDS if getattr(self, k) > 1)
        raise ValueError(
            f"mesh {desc or 'dp=1'} = {self.world_size} ranks but the world has {world_size}; "
            f"make the product of dp, fsdp, tp, pp, cp and ulysses equal {world_size} "
            f"(Mesh.from_world({world_size}, ...) fills dp)"
        )

    def coords(self, rank: int) -> dict[str, int]:
        """Dense coordinates ``{tp, cp, ulysses, fsdp, dp, pp}`` of `rank`.

        Raises ``ValueError`` if `rank` is out of range.
        """
        return _decompose(self._dense(), self._check_rank(rank))

    def expert_coords(self, rank: int) -> dict[str, int]:
        """Expert coordinates ``{etp, ep, edp, pp}`` of `rank`.

        Raises ``ValueError`` if `rank` is out of range.
        """
        return _decompose(self._expert(), self._check_rank(rank))

    def _compose_checked(self, layout: _Layout, coords: dict[str, int]) -> int:
        for name, size in layout:
            value = coords[name]
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
                raise ValueError(
                    f"coordinate {name}={value!r} is out of range for {name}={size}; "
                    f"use an int with 0 <= {name} < {size}"
                )
        return _compose(layout, coords)

    def rank(
        self, *, tp: int = 0, cp: int = 0, ulysses: int = 0, fsdp: int = 0, dp: int = 0, pp: int = 0
    ) -> int:
        """The rank at the given dense coordinates (missing ones are 0); inverse of `coords`.

        Raises ``ValueError`` for a coordinate outside ``[0, size)``.
        """
        coords = dict(tp=tp, cp=cp, ulysses=ulysses, fsdp=fsdp, dp=dp, pp=pp)
        return self._compose_checked(self._dense(), coords)

    def expert_rank(self, *, etp: int = 0, ep: int = 0, edp: int = 0, pp: int = 0) -> int:
        """The rank at the given expert coordinates (missing ones are 0); see `expert_coords`.

        Raises ``ValueError`` for a coordinate outside ``[0, size)``.
        """
        return self._compose_checked(self._expert(), dict(etp=etp, ep=ep, edp=edp, pp=pp))

    def _resolve(self, axes: str | tuple[str, ...]) -> tuple[_Layout, frozenset[str]]:
        names = (axes,) if isinstance(axes, str) else tuple(axes)
        composites = dict(COMPOSITE_AXES)
        expanded: set[str] = set()
        for name in names:
            if name not in GROUP_NAMES:
                raise ValueError(f"unknown mesh axis {name!r}; use one of {', '.join(GROUP_NAMES)}")
            expanded.update(composites.get(name, (name,)))
        expert_only = expanded - set(DENSE_AXES)
        dense_only = expanded - set(EXPERT_AXES)
        if expert_only and dense_only:
            raise ValueError(
                f"axes {names} mix the dense layout ({', '.join(sorted(dense_only))}) and the "
                f"expert layout ({', '.join(sorted(expert_only))}); ask for each layout separately"
            )
        return (self._expert() if expert_only else self._dense()), frozenset(expanded)

    def group_ranks(self, axes: str | tuple[str, ...]) -> list[list[int]]:
        """Partition of the world into groups whose members differ only along `axes`.

        `axes` names dense axes (tp, cp, ulysses, fsdp, dp, pp, and ``dp_total`` = fsdp+dp, ``mp`` = tp+pp)
        or expert axes (etp, ep, edp, and pp); groups, and ranks within a group, are in
        increasing rank order, as megatron-core's ``RankGenerator.get_ranks`` returns them.
        Raises ``ValueError`` for an unknown name or a mix of dense-only and expert-only axes.
        """
        layout, names = self._resolve(axes)
        groups = (_group_of(layout, r, names) for r in range(self.world_size))
        return [g for r, g in enumerate(groups) if g[0] == r]

    def groups_of(self, rank: int) -> dict[str, list[int]]:
        """The group of `rank` along every name in `GROUP_NAMES`.

        Raises ``ValueError`` if `rank` is out of range.
        """
        self._check_rank(rank)
        out = {}
        for name in GROUP_NAMES:
            layout, names = self._resolve(name)
            out[name] = _group_of(layout, rank, names)
        return out

    def data_rank(self, rank: int) -> int:
        """Index of `rank`'s data shard: ``dp * fsdp_size + fsdp`` (tp/cp/ulysses/pp peers share
        it)."""
        c = self.coords(rank)
        return c["dp"] * self.fsdp + c["fsdp"]

    def get_slice(self, total: int, rank: int) -> slice:
        """The contiguous part of a global batch of `total` items that `rank` trains on.

        ``divmod`` split over the `data_world_size` data ranks, as upstream Twinkle: the first
        ``total % n`` data ranks get one extra item. Raises ``ValueError`` if `total` is smaller
        than `data_world_size` (some rank would get nothing) or `rank` is out of range.
        """
        n = self.data_world_size
        if isinstance(total, bool) or not isinstance(total, int):
            raise ValueError(f"get_slice total must be an int batch size, got {total!r}")
        if total < n:
            raise ValueError(
                f"a batch of {total} cannot be split over {n} data ranks; "
                f"use a global batch size that is a multiple of {n}"
            )
        i = self.data_rank(rank)
        k, m = divmod(total, n)
        return slice(i * k + min(i, m), (i + 1) * k + min(i + 1, m))

    def is_pp_first(self, rank: int) -> bool:
        """Whether `rank` is on the first pipeline stage."""
        return self.coords(rank)["pp"] == 0

    def is_pp_last(self, rank: int) -> bool:
        """Whether `rank` is on the last pipeline stage."""
        return self.coords(rank)["pp"] == self.pp - 1

    def is_tp_last(self, rank: int) -> bool:
        """Whether `rank` is the last member of its tensor-parallel group."""
        return self.coords(rank)["tp"] == self.tp - 1
