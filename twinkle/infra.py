"""`initialize`, `remote_class` and `remote_function`: upstream Twinkle's process model, local mode.

In local mode (one process, or one process per rank under torchrun) every call is a plain
in-process call: `remote_class` only injects the global `DeviceMesh` into constructors that take
one and drops the Ray-only ``remote_group``/``instance_id`` arguments, and `remote_function`
records its dispatch/collect policy on the function for the Ray engine to read.

Upstream's API is module-level (``twinkle.initialize(...)`` then constructors pick up the global
mesh), so this module keeps the one piece of process-wide state that the API implies: the
settings of the last `initialize` call, in `_SETTINGS`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect
import random
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from twinkle.device_mesh import DeviceMesh
from twinkle_fn.distributed import init_distributed, world_size

MODES = ("local", "ray")
DISPATCH = ("slice", "all", "slice_dp")
EXECUTE = ("all", "first", "peer")
COLLECT = ("none", "flatten", "mean", "sum", "first", "last_pp", "last_pp_first")
DEFAULT_SEED = 42

_C = TypeVar("_C", bound=type)
_F = TypeVar("_F", bound=Callable[..., Any])


@dataclasses.dataclass(frozen=True)
class DeviceGroup:
    """A named set of ranks (upstream's Ray resource group; recorded in local mode)."""

    name: str
    ranks: list[int] | int
    device_type: str | None = None
    gpus_per_worker: int = 1
    visible_devices: str | None = None


@dataclasses.dataclass(frozen=True)
class Settings:
    """What `initialize` set: the mode, the global mesh, the seed and the device groups."""

    mode: str = "local"
    device_mesh: DeviceMesh | None = None
    seed: int = DEFAULT_SEED
    groups: tuple[DeviceGroup, ...] = ()


@dataclasses.dataclass(frozen=True)
class RemoteFunctionSpec:
    """How the Ray engine dispatches a method's arguments and collects its results."""

    dispatch: str | Callable[..., Any]
    execute: str
    collect: str | Callable[..., Any]
    sync: bool
    lazy_collect: bool | None
    timeout: float | None


@dataclasses.dataclass(frozen=True)
class RemoteClassSpec:
    """How the Ray engine places a class: on every rank (``all``), one actor (``first``)..."""

    execute: str


_SETTINGS: list[Settings] = [Settings()]


def settings() -> Settings:
    """The settings of the last `initialize` call (defaults before any)."""
    return _SETTINGS[0]


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
    """Set up twinkle for this process: join torch.distributed, fix the global mesh, seed.

    Local mode joins the process group the launcher describes (torchrun's environment; nothing
    on a plain single process) and checks that `global_device_mesh` (default: dp over the whole
    world) covers exactly that world. `seed` seeds ``random`` and torch; `full_determinism`
    turns on torch's deterministic algorithms. ``nproc_per_node``, ``ncpu_proc_per_node``,
    ``lazy_collect``, ``name`` and ``notifier`` concern Ray mode and are accepted for
    compatibility. Raises ``ValueError`` for an unknown mode, for ``mode='ray'`` (Ray is not
    installed, or Ray mode is not in this build), and for a mesh that does not match the world.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "ray":
        if importlib.util.find_spec("ray") is None:
            raise ValueError(
                "mode='ray' needs the ray package, which is not installed; "
                "pip install 'twinkle[ray]', or use mode='local' under torchrun"
            )
        raise ValueError(
            "mode='ray' is not available in this build of twinkle yet; use mode='local' "
            "(one process per rank under torchrun)"
        )
    init_distributed()
    world = world_size()
    mesh = global_device_mesh or DeviceMesh.from_sizes(dp_size=world)
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"global_device_mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.world_size != world:
        raise ValueError(
            f"global_device_mesh has {mesh.world_size} ranks but torch.distributed's world has "
            f"{world}; launch {mesh.world_size} processes (torchrun --nproc_per_node "
            f"{mesh.world_size}) or build the mesh for {world}"
        )
    if seed is not None:
        random.seed(seed)
        torch.manual_seed(seed)
    if full_determinism:
        torch.use_deterministic_algorithms(True)
    _SETTINGS[0] = Settings(mode, mesh, DEFAULT_SEED if seed is None else seed, tuple(groups or ()))


def remote_class(execute: str = "peer") -> Callable[[_C], _C]:
    """Class decorator: in local mode the constructor runs in-process, as written.

    The constructor gets the global mesh (from `initialize`) for a parameter annotated
    ``DeviceMesh`` that the caller left out; ``remote_group`` and ``instance_id`` (Ray
    placement) are dropped. The class keeps its name, signature and methods. Raises
    ``ValueError`` for an unknown `execute`.
    """
    _check_choice("execute", execute, EXECUTE)

    def decorate(cls: _C) -> _C:
        init = cls.__init__
        signature = inspect.signature(init)
        mesh_param = _device_mesh_parameter(signature)

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("instance_id", None)
            self._remote_group = kwargs.pop("remote_group", None)
            bound = signature.bind(self, *args, **kwargs)
            if mesh_param and bound.arguments.get(mesh_param) is None:
                bound.arguments[mesh_param] = settings().device_mesh
            init(*bound.args, **bound.kwargs)

        cls.__init__ = __init__
        cls.__twinkle_remote__ = RemoteClassSpec(execute)
        return cls

    return decorate


def remote_function(
    dispatch: str | Callable[..., Any] = "slice",
    execute: str = "all",
    collect: str | Callable[..., Any] = "none",
    sync: bool = False,
    lazy_collect: bool | None = None,
    timeout: float | None = None,
) -> Callable[[_F], _F]:
    """Method decorator: records how Ray mode dispatches and collects; local calls are direct.

    The method itself is returned unchanged, with a `RemoteFunctionSpec` as
    ``__twinkle_remote__``. Raises ``ValueError`` for an unknown dispatch, execute or collect
    name (callables are accepted for dispatch and collect).
    """
    if not callable(dispatch):
        _check_choice("dispatch", dispatch, DISPATCH)
    if not callable(collect):
        _check_choice("collect", collect, COLLECT)
    _check_choice("execute", execute, EXECUTE)
    spec = RemoteFunctionSpec(dispatch, execute, collect, sync, lazy_collect, timeout)

    def decorate(fn: _F) -> _F:
        fn.__twinkle_remote__ = spec
        return fn

    return decorate


def _check_choice(field: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{field} must be one of {', '.join(choices)}, got {value!r}")


def _device_mesh_parameter(signature: inspect.Signature) -> str | None:
    """The name of the constructor parameter annotated with `DeviceMesh`, if any."""
    for param in signature.parameters.values():
        if "DeviceMesh" in str(param.annotation):
            return param.name
    return None
