"""How a `DeviceMesh`'s sizes and rank arrays map onto the core's `twinkle_fn.Mesh`: upstream's
axis names and order against the core's Megatron order, the core mesh a rank array lays out
(checked), the rank array of a core mesh, and the sizes ``from_sizes`` and ``ulysses_size``
give. `twinkle.device_mesh` builds `DeviceMesh` on these."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from twinkle_fn.mesh import Mesh

_AXES = ("dp", "fsdp", "tp", "pp", "cp")
# Upstream's from_sizes order of the axes (what mesh_dim_names lists).
_UPSTREAM_ORDER = ("fsdp", "pp", "dp", "cp", "ulysses", "tp")
# The core's rank order, slowest axis first: how a rank array must be laid out.
_CORE_ORDER = ("pp", "dp", "fsdp", "ulysses", "cp", "tp")


def _carve_ulysses(ulysses: int, fsdp: int, dp: int) -> tuple[int, int]:
    """``(fsdp, dp)`` once `ulysses` ranks are taken out of the data ranks ``fsdp * dp`` (from
    fsdp first, upstream's consecutive data ranks), when it divides both parts it takes from;
    else unchanged (the ulysses axis then adds ranks)."""
    from_fsdp = math.gcd(ulysses, fsdp)
    from_dp = ulysses // from_fsdp
    if ulysses == 1 or dp % from_dp:
        return fsdp, dp
    return fsdp // from_fsdp, dp // from_dp


def _optional_size(name: str, value: int | None) -> int:
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    return value


def _mesh_from_array(
    array: Any,
    names: tuple[str, ...] | None,
    ep_size: int | None,
    etp_size: int | None,
    sequence_parallel: bool | None,
) -> tuple[Mesh, tuple[str, ...]]:
    """The core mesh that lays ranks out as `array` (axes named by `names`) does, and the
    names. Raises ``ValueError`` for missing, unknown or repeated names, a shape that does not
    match them, an array that is not the ranks ``0..n-1`` once each, and a layout other than
    the core's Megatron order."""
    ranks = np.asarray(array)
    if names is None:
        raise ValueError(
            f"DeviceMesh(mesh=<array of shape {ranks.shape}>) needs mesh_dim_names, one name per "
            f"axis from {', '.join(_CORE_ORDER)}, e.g. mesh_dim_names=('dp',)"
        )
    names = tuple(names)
    unknown = [n for n in names if n not in _CORE_ORDER]
    if unknown or len(set(names)) != len(names):
        raise ValueError(
            f"mesh_dim_names={names!r}: each name must be one of {', '.join(_CORE_ORDER)}, "
            "once (expert parallelism is laid over the same ranks: pass ep_size= instead of an "
            "'ep' axis)"
        )
    if len(names) != ranks.ndim:
        raise ValueError(
            f"mesh_dim_names={names!r} names {len(names)} axes but the mesh array has "
            f"{ranks.ndim} (shape {ranks.shape}); give one name per axis"
        )
    world = int(ranks.size)
    if not np.issubdtype(ranks.dtype, np.integer) or sorted(ranks.ravel().tolist()) != list(
        range(world)
    ):
        raise ValueError(
            f"the mesh array must hold the ranks 0..{world - 1} once each, got "
            f"{ranks.ravel().tolist()!r}; build it with np.arange({world}).reshape(...)"
        )
    sizes = dict(zip(names, ranks.shape, strict=True))
    core = Mesh(
        **{axis: sizes.get(axis, 1) for axis in (*_AXES, "ulysses")},
        ep=_optional_size("ep_size", ep_size),
        etp=_optional_size("etp_size", etp_size),
        sequence_parallel=bool(sequence_parallel),
    )
    for index in np.ndindex(ranks.shape):
        rank = int(ranks[index])
        coords = core.coords(rank)
        if any(coords[name] != i for name, i in zip(names, index, strict=True)):
            canonical = [a for a in _CORE_ORDER if a in sizes]
            shape = ", ".join(str(sizes[a]) for a in canonical)
            raise ValueError(
                f"mesh_dim_names={names!r} with this array puts rank {rank} at "
                f"{dict(zip(names, map(int, index), strict=True))}, but the core lays ranks out "
                f"in Megatron order (tp fastest, then cp, ulysses, fsdp, dp, pp) and puts it at "
                f"{ {a: coords[a] for a in names} }; use mesh=np.arange({world}).reshape({shape}) "
                f"with mesh_dim_names={tuple(canonical)!r}, or DeviceMesh.from_sizes(...)"
            )
    return core, names


def _mesh_from_core(
    mesh: Mesh,
    names: tuple[str, ...] | None,
    *,
    ep_size: int | None,
    etp_size: int | None,
    sequence_parallel: bool | None,
    ulysses_size: int | None,
) -> tuple[Mesh, tuple[str, ...]]:
    """A core `mesh` given to ``DeviceMesh`` (with ``ulysses_size`` applied) and the axes its
    rank array names (dp, and every axis of size > 1, in upstream's order). Raises
    ``ValueError`` for `names` (a core mesh names its own axes) and for an ep, etp, sequence
    parallel or ulysses value that disagrees with the mesh's."""
    if names is not None:
        raise ValueError(
            f"mesh_dim_names={names!r} names the axes of a rank array; a twinkle_fn.Mesh names "
            "its own: leave mesh_dim_names unset"
        )
    for field, value in (
        ("ep_size", ep_size),
        ("etp_size", etp_size),
        ("sequence_parallel", sequence_parallel),
    ):
        have = getattr(mesh, field.removesuffix("_size"))
        if value is not None and value != have:
            raise ValueError(
                f"{field}={value!r} disagrees with the mesh's {have!r}; set it on the "
                "twinkle_fn.Mesh and leave it unset here"
            )
    mesh = _with_ulysses(mesh, ulysses_size, from_core=True)
    return mesh, tuple(a for a in _UPSTREAM_ORDER if a == "dp" or getattr(mesh, a) > 1)


def _with_ulysses(mesh: Mesh, ulysses_size: int | None, from_core: bool) -> Mesh:
    """`mesh` with ``ulysses = ulysses_size`` (the core's Ulysses axis). Raises ``ValueError``
    when a core mesh has another ulysses size, or for ulysses with a rank array."""
    size = _optional_size("ulysses_size", ulysses_size)
    if ulysses_size is None or size == mesh.ulysses:
        return mesh
    if not from_core:
        raise ValueError(
            f"ulysses_size={ulysses_size} with a rank array whose ulysses axis is {mesh.ulysses}; "
            "name a 'ulysses' axis in mesh_dim_names, or use DeviceMesh.from_sizes(..., "
            "ulysses_size=...)"
        )
    if mesh.ulysses != 1:
        raise ValueError(
            f"ulysses_size={ulysses_size!r} disagrees with the mesh's {mesh.ulysses!r}; set it on "
            "the twinkle_fn.Mesh and leave it unset here"
        )
    return dataclasses.replace(mesh, ulysses=size)


def _rank_array(core: Mesh, names: tuple[str, ...]) -> np.ndarray:
    """The global ranks of `core` as an array over the axes `names` (every axis of size > 1
    among them): ``array[i, j, ...]`` is the rank at those coordinates."""
    full = np.arange(core.world_size).reshape([getattr(core, a) for a in _CORE_ORDER])
    named = [_CORE_ORDER.index(n) for n in names]
    rest = [i for i in range(len(_CORE_ORDER)) if i not in named]  # each of size 1
    return full.transpose(named + rest).reshape([getattr(core, n) for n in names])
