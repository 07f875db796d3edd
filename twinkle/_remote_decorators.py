"""`remote_class` and `remote_function`: how upstream's classes and methods say where they run.

In-process (local mode, or Ray mode without ``remote_group``) both decorators leave the code as
written: `remote_class` only fills in the global mesh and drops the Ray-only arguments, and
`remote_function` records its policy (a `RemoteFunctionSpec`) on the method. In Ray mode a
`remote_class` built with ``remote_group='name'`` becomes a handle on Ray actors
(`twinkle._ray_engine`), whose methods follow those policies (`twinkle._remote_dispatch`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from twinkle._infra_settings import _SETTINGS, DeviceGroup, Settings, seed_everything, settings
from twinkle.device_mesh import DeviceMesh

DISPATCH = ("slice", "all", "slice_dp")
EXECUTE = ("all", "first", "peer")
COLLECT = ("none", "flatten", "mean", "sum", "first", "last_pp", "last_pp_first")

_C = TypeVar("_C", bound=type)
_F = TypeVar("_F", bound=Callable[..., Any])


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


def remote_class(execute: str = "peer") -> Callable[[_C], _C]:
    """Class decorator: the object is built in-process, or in Ray actors with ``remote_group``.

    In-process (local mode, or Ray mode without ``remote_group``) the constructor runs as
    written; it gets the global mesh (from `initialize`) for a parameter annotated
    ``DeviceMesh`` that the caller left out (in Ray mode, an ``execute='first'`` class gets a
    one-rank mesh instead: the driver's DataLoader yields whole global batches, as upstream),
    and ``remote_group``/``instance_id`` are dropped.

    In Ray mode with ``remote_group='name'`` the call returns a handle (an instance of a subclass
    of the class, see `twinkle._ray_engine`) whose object lives in one Ray actor per rank of its
    mesh (the caller's, else the global one; a class without a mesh parameter gets dp over the
    group), or in one actor with a one-rank mesh for ``execute='first'``. Raises ``ValueError``
    for an unknown `execute`, and at construction for an unknown group or a mesh whose size is
    not the group's.
    """
    _check_choice("execute", execute, EXECUTE)

    def decorate(cls: _C) -> _C:
        init = cls.__init__
        base_new = cls.__new__
        signature = inspect.signature(init)
        mesh_param = _device_mesh_parameter(signature)

        def __new__(klass: type, *args: Any, **kwargs: Any) -> Any:
            if settings().mode == "ray" and kwargs.get("remote_group") is not None:
                return _remote_instance(klass, signature, mesh_param, execute, args, kwargs)
            if base_new is object.__new__:
                return object.__new__(klass)
            return base_new(klass, *args, **kwargs)

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("instance_id", None)
            self._remote_group = kwargs.pop("remote_group", None)
            bound = signature.bind(self, *args, **kwargs)
            if mesh_param and bound.arguments.get(mesh_param) is None:
                ray_first = settings().mode == "ray" and execute == "first"
                mesh = DeviceMesh.from_sizes(dp_size=1) if ray_first else settings().device_mesh
                bound.arguments[mesh_param] = mesh
            init(*bound.args, **bound.kwargs)

        __new__.__signature__ = signature  # inspect.signature(cls) shows the constructor's
        cls.__new__ = staticmethod(__new__)
        cls.__init__ = __init__
        cls.__twinkle_remote__ = RemoteClassSpec(execute)
        return cls

    return decorate


def _remote_instance(
    klass: type,
    signature: inspect.Signature,
    mesh_param: str | None,
    execute: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """The ray-mode handle of ``klass(*args, **kwargs)`` placed on ``kwargs['remote_group']``."""
    from twinkle import _ray_engine

    kwargs = dict(kwargs)
    group = _group(kwargs.pop("remote_group"))
    kwargs.pop("instance_id", None)
    bound = signature.bind(None, *args, **kwargs)  # a TypeError for bad arguments, here
    size = _ray_engine.group_size(group)
    if execute == "first":
        world, mesh = 1, DeviceMesh.from_sizes(dp_size=1)
    else:
        world = size
        mesh = bound.arguments.get(mesh_param) if mesh_param else None
        mesh = mesh or (
            settings().device_mesh if mesh_param else DeviceMesh.from_sizes(dp_size=size)
        )
    if mesh.world_size != world:
        raise ValueError(
            f"{klass.__name__}'s device_mesh has {mesh.world_size} ranks but DeviceGroup "
            f"{group.name!r} has {world}; build the mesh for {world} ranks or use a group "
            f"of {mesh.world_size}"
        )
    if mesh_param:
        bound.arguments[mesh_param] = mesh
    s = settings()
    actor_settings = Settings("local", mesh, s.seed, (), s.full_determinism)
    factory = functools.partial(
        _construct_in_actor, klass, actor_settings, bound.args[1:], bound.kwargs
    )
    return _ray_engine.create_handle(klass, factory, group, world, mesh)


def _group(name: str) -> DeviceGroup:
    groups = settings().groups
    for group in groups:
        if group.name == name:
            return group
    raise ValueError(
        f"remote_group={name!r} is not one of the DeviceGroups given to initialize: "
        f"{[g.name for g in groups]}"
    )


def _construct_in_actor(
    klass: type, actor_settings: Settings, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Build the object in a Ray actor: local-mode settings over the object's mesh, seeded as
    the driver, then the constructor."""
    _SETTINGS[0] = actor_settings
    seed_everything(actor_settings.seed, actor_settings.full_determinism)
    return klass(*args, **kwargs)


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
