"""`initialize`, `remote_class` and `remote_function`: upstream Twinkle's process model.

Local mode (one process, or one process per rank under torchrun): every call is a plain
in-process call; `remote_class` only injects the global `DeviceMesh` into constructors that take
one and drops the Ray-only ``remote_group``/``instance_id`` arguments, and `remote_function`
records its dispatch/collect policy on the function.

Ray mode (``initialize(mode='ray', groups=[DeviceGroup(...)])``): constructing a `remote_class`
with ``remote_group='name'`` starts one Ray actor per rank of its mesh on that group and returns a
handle whose methods run in the actors, dispatched and collected by their `remote_function`
policy (`twinkle._ray_engine`, `twinkle._remote_dispatch`). Without ``remote_group`` the object
is built in the driver, as upstream. `shutdown` ends Ray mode.

This module sets the process up (`initialize`, `shutdown`) and draws it
(`get_device_placement`); the settings it records (`settings`, `DeviceGroup`; the state itself
in `_SETTINGS`) live in `twinkle._infra_settings`, the decorators in
`twinkle._remote_decorators`. Upstream's scripts import all of them from here.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from twinkle._infra_settings import (
    _SETTINGS,
    DEFAULT_SEED,
    DeviceGroup,
    Settings,
    seed_everything,
    settings,
)
from twinkle._remote_decorators import (
    COLLECT,
    DISPATCH,
    EXECUTE,
    RemoteClassSpec,
    RemoteFunctionSpec,
    remote_class,
    remote_function,
)
from twinkle.device_mesh import DeviceMesh
from twinkle_fn.distributed import world_size

__all__ = [
    "COLLECT",
    "DEFAULT_SEED",
    "DISPATCH",
    "EXECUTE",
    "MODES",
    "DeviceGroup",
    "RemoteClassSpec",
    "RemoteFunctionSpec",
    "Settings",
    "get_device_placement",
    "initialize",
    "remote_class",
    "remote_function",
    "settings",
    "shutdown",
]

MODES = ("local", "ray")


def initialize(
    mode: str = "local",
    nproc_per_node: int = 8,
    ncpu_proc_per_node: int = 8,
    seed: int | None = DEFAULT_SEED,
    full_determinism: bool = False,
    groups: list[DeviceGroup] | None = None,
    global_device_mesh: DeviceMesh | None = None,
    lazy_collect: bool = True,
    name: str | None = None,
    notifier: Any = None,
) -> None:
    """Set up twinkle for this process: the mode, the global mesh, the seed.

    Local mode only reads the launcher's environment (torchrun's ``WORLD_SIZE``; one rank on a
    plain process) and checks that `global_device_mesh` (default: dp over the whole world)
    covers exactly that world. It joins no process group, as upstream: the first model built
    joins torch.distributed. So a child process started by ``spawn`` (megatron's checkpoint
    writer) that re-runs the script's top-level ``initialize`` returns at once instead of
    waiting for peers that never come.

    Ray mode starts a local Ray cluster with ``min(ncpu_proc_per_node, cpu count)`` CPUs (or
    joins ``RAY_ADDRESS``'s; an already initialized Ray is used as it is) and records `groups`,
    the `DeviceGroup` s that ``remote_group=`` names (default: one group ``'default'`` of the
    mesh's ranks); `global_device_mesh` defaults to dp over the first group. A group's
    ``device_type`` is 'CPU' (gloo), 'GPU' (NCCL, ``gpus_per_worker`` GPUs per rank) or None
    (GPUs when the cluster has them).

    `seed` seeds ``random`` and torch (here and in every actor); `full_determinism` turns on
    torch's deterministic algorithms. ``nproc_per_node`` (Ray finds the GPUs itself),
    ``lazy_collect`` (results are always collected at once), ``name`` and ``notifier`` are
    accepted for compatibility. Raises ``ValueError`` for an unknown mode, a mesh that does not
    match the world (local), and in Ray mode for a missing ray package, neither groups nor a
    mesh, duplicate group names, bad ranks, ``visible_devices``, or more GPUs than the cluster
    has.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if global_device_mesh is not None and not isinstance(global_device_mesh, DeviceMesh):
        raise TypeError(
            f"global_device_mesh must be a DeviceMesh, got {type(global_device_mesh).__name__}"
        )
    recorded_seed = DEFAULT_SEED if seed is None else seed
    if mode == "ray":
        new = _ray_settings(
            ncpu_proc_per_node, recorded_seed, full_determinism, groups, global_device_mesh
        )
    else:
        world = _launcher_world()
        mesh = global_device_mesh or DeviceMesh.from_sizes(dp_size=world)
        if mesh.world_size != world:
            raise ValueError(
                f"global_device_mesh has {mesh.world_size} ranks but torch.distributed's world "
                f"has {world}; launch {mesh.world_size} processes (torchrun --nproc_per_node "
                f"{mesh.world_size}) or build the mesh for {world}"
            )
        new = Settings(mode, mesh, recorded_seed, tuple(groups or ()), full_determinism)
    seed_everything(seed, full_determinism)
    _SETTINGS[0] = new


def _launcher_world() -> int:
    """The world size: torch.distributed's when joined, else the launcher's ``WORLD_SIZE``,
    else 1. Raises ``ValueError`` for a ``WORLD_SIZE`` that is not a positive int."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return world_size()
    raw = os.environ.get("WORLD_SIZE")
    if raw is None:
        return 1
    try:
        world = int(raw)
    except ValueError:
        world = 0
    if world < 1:
        raise ValueError(
            f"environment variable WORLD_SIZE={raw!r} is not a positive int; launch with "
            "torchrun or unset it for a single process"
        )
    return world


def get_device_placement(device_group: list[DeviceGroup] | None = None) -> str:
    """A text picture of the training topology: each device group, its ranks and the mesh.

    `device_group` defaults to the groups of the last `initialize` (in local mode without
    groups: one group ``'default'`` over the mesh's ranks). Returns
    ``'No device group provided.'`` before `initialize` and when there is none, as upstream.
    """
    s = settings()
    groups = list(device_group) if device_group is not None else list(s.groups)
    if not groups and device_group is None and s.device_mesh is not None:
        groups = [DeviceGroup("default", list(range(s.device_mesh.world_size)), "CPU")]
        if torch.cuda.is_available():
            groups[0] = dataclasses.replace(groups[0], device_type="GPU")
    if not groups:
        return "No device group provided."
    width = 80

    def line(text: str = "") -> str:
        return f"│ {text.ljust(width - 4)} │"

    title = "║ " + "DEVICE PLACEMENT TOPOLOGY".center(width - 4) + " ║"
    lines = ["╔" + "═" * (width - 2) + "╗", title, "╚" + "═" * (width - 2) + "╝", ""]
    for group in groups:
        ranks = group.ranks if isinstance(group.ranks, list) else list(range(group.ranks))
        shown = str(ranks) if len(ranks) <= 16 else f"{ranks[:6]} ... {ranks[-3:]}"
        lines += ["┌" + "─" * (width - 2) + "┐", line(f"◈ DeviceGroup: {group.name}")]
        lines += ["├" + "─" * (width - 2) + "┤", line(f"  ├─ Device Type : {group.device_type}")]
        lines.append(line(f"  └─ Ranks       : {shown} ({len(ranks)} total)"))
        mesh = s.device_mesh
        if mesh is not None and mesh.world_size == len(ranks):
            dims = " × ".join(f"{d}={mesh.get_dim_size(d)}" for d in mesh.mesh_dim_names)
            lines += [line(), line("  ┌─ DeviceMesh: global"), line(f"  │  Dimensions : {dims}")]
            active = [
                f"{d.upper()}={mesh.get_dim_size(d)}"
                for d in ("pp", "dp", "tp", "ep", "cp", "fsdp")
                if mesh.get_dim_size(d) > 1
            ]
            if active:
                lines.append(line(f"  │  Parallelism: {', '.join(active)}"))
        lines += [line(), "└" + "─" * (width - 2) + "┘", ""]
    return "\n" + "\n".join(lines)


def _ray_settings(
    ncpu_proc_per_node: int,
    seed: int,
    full_determinism: bool,
    groups: list[DeviceGroup] | None,
    mesh: DeviceMesh | None,
) -> Settings:
    """Ray mode's settings, after checking the groups and starting (or joining) Ray."""
    from twinkle import _ray_engine

    if not groups and mesh is None:
        raise ValueError(
            "mode='ray' needs groups=[DeviceGroup(name, ranks)] (where remote_group= places "
            "objects) or global_device_mesh=DeviceMesh.from_sizes(...)"
        )
    groups = tuple(groups or (DeviceGroup("default", mesh.world_size),))
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise ValueError(f"DeviceGroup names must be unique, got {names}")
    for group in groups:
        _check_group(group)
    started = _ray_engine.start_ray(max(1, min(ncpu_proc_per_node, os.cpu_count() or 1)))
    try:
        for group in groups:
            _ray_engine.uses_gpus(group)  # raises now, not when an object is placed
    except ValueError:
        if started:
            _ray_engine.stop_ray()
        raise
    # A second initialize keeps ending the cluster that the first one started.
    started = started or (settings().mode == "ray" and settings().ray_started)
    mesh = mesh or DeviceMesh.from_sizes(dp_size=_ray_engine.group_size(groups[0]))
    return Settings("ray", mesh, seed, groups, full_determinism, started)


def _check_group(group: DeviceGroup) -> None:
    ranks = group.ranks
    bad_int = isinstance(ranks, int) and (isinstance(ranks, bool) or ranks < 1)
    bad_list = not isinstance(ranks, int) and (
        not ranks or len(set(ranks)) != len(ranks) or any(r < 0 for r in ranks)
    )
    if bad_int or bad_list:
        raise ValueError(
            f"DeviceGroup {group.name!r}: ranks must be a positive count or a list of distinct "
            f"ranks, got {ranks!r}"
        )
    if group.gpus_per_worker < 1:
        raise ValueError(f"DeviceGroup {group.name!r}: gpus_per_worker must be >= 1")
    if group.visible_devices is not None:
        raise ValueError(
            f"DeviceGroup {group.name!r}: visible_devices is not supported in this build (Ray "
            "assigns the GPUs); restrict them with CUDA_VISIBLE_DEVICES before starting Ray"
        )


def shutdown() -> None:
    """Leave Ray mode: disconnect from Ray (ending the cluster `initialize` started, and with it
    the actors of every remote object) and go back to the default local settings. A no-op in
    local mode."""
    if settings().mode == "ray" and settings().ray_started:
        from twinkle import _ray_engine

        _ray_engine.stop_ray()
    _SETTINGS[0] = Settings()
