"""`DeviceMesh`: upstream Twinkle's mesh object, as a view of `twinkle_fn.Mesh`.

The sizes live in a `twinkle_fn.Mesh` (the ``mesh`` property), so the class API and the core agree
on every rank's coordinates. Ranks follow the core's Megatron order (``tp-cp-fsdp-dp-pp``, tp
fastest) rather than upstream's numpy layout (``fsdp, pp, dp, cp, tp``); what a rank trains on is
the same in both: ``data_rank = dp_rank * fsdp_size + fsdp_rank`` over ``data_world_size = dp *
fsdp`` data shards.

As upstream, ``mesh`` is the numpy array of global ranks (axes named by ``mesh_dim_names``), a
rank query for an axis the names leave out, or from a rank outside the array, answers None, and
ranks come from `Platform.get_rank` (the launcher's ``RANK``; torch.distributed's rank, else 0,
outside a launcher). The core mesh is ``core_mesh``.

Differences from upstream, all deliberate: an axis that was not set reports size 1 (upstream:
0); ``get_slice`` refuses a batch smaller than the number of data ranks (upstream hands some
ranks nothing); ``vpp_size > 1`` is refused (upstream marks VPP as broken); ``ulysses_size`` is
the core's ``ulysses`` axis, named in ``mesh_dim_names`` when larger than 1. As upstream,
`from_sizes` carves it out of the data ranks ``dp * fsdp`` when it divides them (from fsdp
first: ``from_sizes(dp_size=2, fsdp_size=2, ulysses_size=2)`` is 4 ranks, 2 data shards); the
core's ulysses ranks hold whole parameters (fsdp shrinks by the ulysses size), so the math is
upstream's and only the parameter memory differs. Where it does not divide them (upstream
refuses) the ulysses axis adds its own ranks (``from_sizes(ulysses_size=2)`` is 2 ranks); a rank array
(``DeviceMesh(mesh=np.ndarray, mesh_dim_names=...)``) must follow the core's order, so
upstream's ``from_sizes`` layout with fsdp outermost is refused when fsdp > 1 meets dp or pp > 1
(`from_sizes` here builds the core's layout instead, naming the axes in the core's order).

The mapping between those layouts and the core mesh (axis orders, rank arrays checked and
built, the sizes `from_sizes` takes) is in `twinkle._mesh_layout`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch.distributed as dist

from twinkle._mesh_layout import (
    _AXES,
    _UPSTREAM_ORDER,
    _carve_ulysses,
    _mesh_from_array,
    _mesh_from_core,
    _optional_size,
    _rank_array,
    _with_ulysses,
)
from twinkle.platform import Platform
from twinkle_fn.mesh import Mesh


def current_rank() -> int:
    """This process's global rank: torch.distributed's, else the launcher's ``RANK``, else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _platform_rank() -> int:
    """The rank `Platform.get_rank` reports (upstream's source of ranks), or, outside a
    launcher (-1), `current_rank`."""
    rank = Platform.get_rank()
    return rank if rank >= 0 else current_rank()


def _with_names(core: Mesh, given: dict[str, int | None], extra: dict[str, Any]) -> DeviceMesh:
    """The `DeviceMesh` of `core` naming, in upstream's order, every axis of size > 1 and every
    axis `given` a size."""
    names = tuple(a for a in _UPSTREAM_ORDER if given.get(a) is not None or getattr(core, a) > 1)
    return DeviceMesh(
        _rank_array(core, names),
        names,
        ep_size=core.ep,
        etp_size=core.etp,
        sequence_parallel=core.sequence_parallel,
        **extra,
    )


@dataclasses.dataclass(frozen=True, eq=False)
class DeviceMesh:
    """The parallel layout of a job: a `twinkle_fn.Mesh` plus upstream's extra attributes.

    Build it with `from_sizes`, from a `twinkle_fn.Mesh`, or as upstream does from a rank array:
    ``DeviceMesh(mesh=np.arange(8).reshape(2, 4), mesh_dim_names=('dp', 'tp'))``. The array
    must lay ranks out as the core does (Megatron order, tp fastest: the names read in the
    order ``pp, dp, fsdp, cp, tp``, any of them left out), as `from_sizes`'s meshes and
    upstream's tests do; other layouts are refused. After construction ``mesh`` is always the
    array of global ranks (``mesh[coords]`` is the rank at those coordinates of the axes
    ``mesh_dim_names`` names), ``core_mesh`` the `twinkle_fn.Mesh`, and ``ep_size``,
    ``etp_size``, ``ep_fsdp_size`` and ``sequence_parallel`` hold the mesh's values. ``device_type`` is kept
    for upstream compatibility; the core picks CUDA when it is available.
    """

    mesh: Any = dataclasses.field(default_factory=Mesh)
    mesh_dim_names: tuple[str, ...] | None = None
    ep_size: int | None = None
    etp_size: int | None = None
    ep_fsdp_size: int | None = None
    vpp_size: int | None = None
    ulysses_size: int | None = None
    sequence_parallel: bool | None = None
    device_type: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.mesh, Mesh):
            mesh, names = _mesh_from_core(
                self.mesh,
                self.mesh_dim_names,
                ep_size=self.ep_size,
                etp_size=self.etp_size,
                sequence_parallel=self.sequence_parallel,
                ulysses_size=self.ulysses_size,
            )
        else:
            mesh, names = _mesh_from_array(
                self.mesh, self.mesh_dim_names, self.ep_size, self.etp_size, self.sequence_parallel
            )
        if self.ep_fsdp_size is not None and self.ep_fsdp_size != mesh.edp:
            raise ValueError(
                f"ep_fsdp_size={self.ep_fsdp_size!r} but this mesh shards experts over "
                f"world // (etp * ep * pp) = {mesh.edp} ranks; leave ep_fsdp_size unset"
            )
        if _optional_size("vpp_size", self.vpp_size) > 1:
            raise ValueError(
                f"vpp_size={self.vpp_size}: virtual pipeline parallelism is not supported "
                "(upstream Twinkle documents it as broken); leave vpp_size unset"
            )
        if not isinstance(self.mesh, Mesh):
            mesh = _with_ulysses(mesh, self.ulysses_size, from_core=False)
        # Frozen: the normalized values are written once, here.
        object.__setattr__(self, "_core", mesh)
        object.__setattr__(self, "mesh", _rank_array(mesh, names))
        object.__setattr__(self, "mesh_dim_names", names)
        object.__setattr__(self, "ep_size", mesh.ep)
        object.__setattr__(self, "etp_size", mesh.etp)
        object.__setattr__(self, "ep_fsdp_size", mesh.edp if mesh.ep > 1 else self.ep_fsdp_size)
        object.__setattr__(self, "sequence_parallel", mesh.sequence_parallel)
        object.__setattr__(self, "ulysses_size", mesh.ulysses)

    @property
    def core_mesh(self) -> Mesh:
        """The core's `twinkle_fn.Mesh` that this mesh views."""
        return self._core

    def _key(self) -> tuple:
        return (self._core, self.mesh_dim_names, self.ep_fsdp_size, self.device_type)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeviceMesh) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    @staticmethod
    def from_sizes(
        *,
        world_size: int = 1,
        dp_size: int | None = 1,
        fsdp_size: int | None = None,
        tp_size: int | None = None,
        pp_size: int | None = None,
        ulysses_size: int | None = None,
        cp_size: int | None = None,
        ep_size: int | None = None,
        etp_size: int | None = 1,
        ep_fsdp_size: int | None = None,
        vpp_size: int | None = None,
        device_type: str | None = None,
        sequence_parallel: bool = False,
    ) -> DeviceMesh:
        """The mesh with these sizes (unset ones are 1), as upstream's ``from_sizes``.

        With the default ``world_size=1`` the world is the product of the sizes; a larger
        `world_size` must equal that product, or, with ``dp_size=None``, dp fills the rest.
        ``ep_fsdp_size`` may be left out (the core shards experts over ``world // (etp * ep *
        pp)`` ranks, upstream's ``world // ep`` without pp or etp) or given as that number.
        Raises ``ValueError`` for sizes that do not multiply to `world_size`, for
        ``vpp_size > 1``, another ``ep_fsdp_size``, and for what
        `twinkle_fn.Mesh` rejects.
        """
        sizes = {
            "fsdp": _optional_size("fsdp_size", fsdp_size),
            "tp": _optional_size("tp_size", tp_size),
            "pp": _optional_size("pp_size", pp_size),
            "cp": _optional_size("cp_size", cp_size),
            "ep": _optional_size("ep_size", ep_size),
            "etp": _optional_size("etp_size", etp_size),
            "ulysses": _optional_size("ulysses_size", ulysses_size),
        }
        extra = {
            "vpp_size": vpp_size,
            "device_type": device_type,
            "ep_fsdp_size": ep_fsdp_size,
        }
        # Upstream names every axis given a size (and dp), so its rank is 0, not None, at size 1.
        given = {"dp": 1, "fsdp": fsdp_size, "tp": tp_size, "pp": pp_size, "cp": cp_size}
        if dp_size is None:
            mesh = Mesh.from_world(world_size, **sizes, sequence_parallel=sequence_parallel)
            return _with_names(mesh, given, extra)
        dp = _optional_size("dp_size", dp_size)
        sizes["fsdp"], dp = _carve_ulysses(sizes["ulysses"], sizes["fsdp"], dp)
        mesh = Mesh(dp=dp, **sizes, sequence_parallel=sequence_parallel)
        if world_size != 1 and world_size != mesh.world_size:
            desc = " x ".join(f"{a}={getattr(mesh, a)}" for a in _AXES if getattr(mesh, a) > 1)
            raise ValueError(
                f"world_size={world_size} but the sizes give {desc or 'dp=1'} = "
                f"{mesh.world_size} ranks; make their product {world_size}, or pass "
                "dp_size=None to let dp fill the world"
            )
        return _with_names(mesh, given, extra)

    # Sizes.
    @property
    def world_size(self) -> int:
        """Ranks in the mesh: ``dp * fsdp * tp * pp * cp * ulysses``."""
        return self.core_mesh.world_size

    @property
    def dp_world_size(self) -> int:
        """Replicas (the ``dp`` axis)."""
        return self.core_mesh.dp

    @property
    def fsdp_world_size(self) -> int:
        """Shards of the fully sharded data-parallel axis."""
        return self.core_mesh.fsdp

    @property
    def tp_world_size(self) -> int:
        """Tensor-parallel size."""
        return self.core_mesh.tp

    @property
    def pp_world_size(self) -> int:
        """Pipeline stages."""
        return self.core_mesh.pp

    @property
    def cp_world_size(self) -> int:
        """Context-parallel size."""
        return self.core_mesh.cp

    @property
    def ep_world_size(self) -> int:
        """Expert-parallel size (laid over the same ranks)."""
        return self.core_mesh.ep

    @property
    def etp_world_size(self) -> int:
        """Expert tensor-parallel size."""
        return self.core_mesh.etp

    @property
    def data_world_size(self) -> int:
        """Distinct data shards: ``dp * fsdp``."""
        return self.core_mesh.data_world_size

    @property
    def order(self) -> str:
        """Megatron's rank order, as upstream reports it."""
        return "tp-cp-ep-dp-pp"

    @property
    def is_single_process(self) -> bool:
        """One rank and no launcher around it."""
        return self.world_size == 1 and "RANK" not in os.environ

    def has_dim(self, dim_name: str) -> bool:
        """Whether axis `dim_name` has size > 1 (``dp`` is always present)."""
        return dim_name == "dp" or self.get_dim_size(dim_name) > 1

    def get_dim_size(self, dim_name: str) -> int:
        """Size of axis `dim_name`. Raises ``ValueError`` for an unknown axis."""
        if dim_name not in (*_AXES, "ep", "etp", "ulysses"):
            raise ValueError(f"unknown mesh axis {dim_name!r}; use one of {', '.join(_AXES)}, ep")
        return getattr(self.core_mesh, dim_name)

    # This process's coordinates.
    def _coord(self, axis: str) -> int | None:
        """This process's index on `axis`; None when the names leave `axis` out or this rank
        is not in the mesh, as upstream's lookup in its rank array."""
        rank = _platform_rank()
        if axis not in self.mesh_dim_names or not 0 <= rank < self.world_size:
            return None
        return self.core_mesh.coords(rank)[axis]

    def _own_rank(self) -> int:
        rank = _platform_rank()
        if not 0 <= rank < self.world_size:
            raise ValueError(
                f"this process is rank {rank} but the mesh has {self.world_size} ranks; "
                f"launch {self.world_size} processes or build a mesh for this world"
            )
        return rank

    @property
    def dp_rank(self) -> int | None:
        """This process's replica index."""
        return self._coord("dp")

    @property
    def fsdp_rank(self) -> int | None:
        """This process's shard index on the fsdp axis."""
        return self._coord("fsdp")

    @property
    def tp_rank(self) -> int | None:
        """This process's tensor-parallel index."""
        return self._coord("tp")

    @property
    def pp_rank(self) -> int | None:
        """This process's pipeline stage."""
        return self._coord("pp")

    @property
    def cp_rank(self) -> int | None:
        """This process's context-parallel index."""
        return self._coord("cp")

    @property
    def ep_rank(self) -> int:
        """This process's expert-parallel index."""
        return self.core_mesh.expert_coords(self._own_rank())["ep"]

    @property
    def data_rank(self) -> int:
        """This process's data shard: ``dp_rank * fsdp_size + fsdp_rank``."""
        return self.core_mesh.data_rank(self._own_rank())

    def get_data_rank_from_global_rank(self, global_rank: int) -> int:
        """The data shard of `global_rank`. Raises ``ValueError`` if it is out of range."""
        return self.core_mesh.data_rank(global_rank)

    def get_slice(self, total_length: int, rank: int | None = None) -> slice:
        """The contiguous part of a global batch of `total_length` that data rank `rank` gets.

        `rank` is a *data* rank (default: this process's), as upstream; the split is a divmod,
        the first ``total_length % data_world_size`` data ranks getting one extra item. Raises
        ``ValueError`` when some data rank would get nothing or `rank` is out of range.
        """
        n = self.data_world_size
        if rank is None:
            rank = self.data_rank if n > 1 else 0
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < n:
            raise ValueError(f"data rank {rank!r} is out of range for {n} data ranks")
        fsdp_index, dp_index = rank % self.core_mesh.fsdp, rank // self.core_mesh.fsdp
        return self.core_mesh.get_slice(
            total_length, self.core_mesh.rank(dp=dp_index, fsdp=fsdp_index)
        )

    def get_collect_ranks(self) -> list[int]:
        """One global rank per data rank (tp/cp rank 0 of the last pipeline stage)."""
        last = self.pp_world_size - 1
        return [
            self.core_mesh.rank(dp=d // self.core_mesh.fsdp, fsdp=d % self.core_mesh.fsdp, pp=last)
            for d in range(self.data_world_size)
        ]

    def get_tp_ranks(self) -> list[int]:
        """The ranks of this process's tensor-parallel group."""
        return self.core_mesh.groups_of(self._own_rank())["tp"]

    def get_tp_last_ranks(self) -> list[int]:
        """Every rank that is the last of its tensor-parallel group."""
        return [r for r in range(self.world_size) if self.core_mesh.is_tp_last(r)]

    def is_tp_last_rank(self, rank: int | None = None) -> bool:
        """Whether `rank` (default: this process) is the last of its tensor-parallel group."""
        return self.core_mesh.is_tp_last(self._own_rank() if rank is None else rank)

    def get_pp_stage_ranks(self, stage: int) -> list[int]:
        """The ranks of pipeline stage `stage`. Raises ``ValueError`` for a stage out of range."""
        if not 0 <= stage < self.pp_world_size:
            raise ValueError(f"stage {stage} is out of range for {self.pp_world_size} stages")
        return [r for r in range(self.world_size) if self.core_mesh.coords(r)["pp"] == stage]

    def get_pp_first_ranks(self) -> list[int]:
        """The ranks of the first pipeline stage."""
        return self.get_pp_stage_ranks(0)

    def get_pp_last_ranks(self) -> list[int]:
        """The ranks of the last pipeline stage."""
        return self.get_pp_stage_ranks(self.pp_world_size - 1)

    def is_pp_first_rank(self) -> bool:
        """Whether this process is on the first pipeline stage."""
        return self.core_mesh.is_pp_first(self._own_rank())

    def is_pp_last_rank(self) -> bool:
        """Whether this process is on the last pipeline stage."""
        return self.core_mesh.is_pp_last(self._own_rank())

    def __str__(self) -> str:
        desc = " x ".join(f"{a}={self.get_dim_size(a)}" for a in self.mesh_dim_names)
        return f"DeviceMesh({desc}, world_size={self.world_size})"
