"""Ray mode of `twinkle.infra`: a remote object is one Ray actor per rank of its `DeviceMesh`.

`start_ray` starts (or joins) a Ray cluster. `create_handle` places an object: it starts one
`RankWorker` actor per rank (CPU-only actors over gloo, or GPU actors over NCCL), joins them into
one torch.distributed world with the environment torchrun would give (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), and constructs the real object in every actor.
Rank 0's actor hosts the rendezvous store on a port it binds itself, so no other process can take
the port between choosing it and using it.

The driver gets a *handle*: an instance of a subclass of the object's class whose public methods
run in the actors. A method decorated with `remote_function` follows its `RemoteFunctionSpec`
(`twinkle._remote_dispatch` splits the arguments and combines the results); an undecorated one
runs on every rank with the same arguments and returns rank 0's result; ``len()``, indexing and
iteration run on rank 0. Properties and instance attributes live in the actors and are not
readable from the handle.

An exception in an actor is raised in the driver (Ray's error, an instance of the actor's
exception class, with the actor's traceback), tagged with the rank. When the other ranks do not
finish within `ERROR_GRACE_S` (they wait in a collective for the failed rank), the actors are
stopped and the handle refuses further calls.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch.distributed as dist

from twinkle._remote_dispatch import collect_results, dispatch_args
from twinkle.device_mesh import DeviceMesh
from twinkle.infra import DeviceGroup, RemoteFunctionSpec
from twinkle_fn.distributed import init_distributed

# Undecorated public methods: every rank, the same arguments, rank 0's result.
DEFAULT_METHOD_SPEC = RemoteFunctionSpec("all", "all", "first", False, None, None)
_FIRST = RemoteFunctionSpec("all", "first", "none", False, None, None)
ERROR_GRACE_S = 10.0  # how long the other ranks may take to finish after one rank failed
_HANDLE_ATTRIBUTE = "_twinkle_actors"


def import_ray() -> Any:
    """The ``ray`` module. Raises ``ValueError`` (naming the extra to install) without it."""
    try:
        import ray
    except ImportError:
        raise ValueError(
            "mode='ray' needs the ray package, which is not installed; "
            "pip install 'twinkle[ray]', or use mode='local' under torchrun"
        ) from None
    return ray


def start_ray(num_cpus: int) -> bool:
    """Start a local Ray cluster with `num_cpus` CPUs (no dashboard, warnings only), or join
    the one ``RAY_ADDRESS`` names; nothing when Ray is already initialized in this process.
    Returns whether this call started or joined one (and so `stop_ray` should end it)."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    quiet = dict(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True)
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], logging_level=logging.WARNING)
    else:
        ray.init(num_cpus=num_cpus, **quiet)
    return True


def stop_ray() -> None:
    """Disconnect from Ray (a cluster this process started ends, its actors with it)."""
    import_ray().shutdown()


def group_size(group: DeviceGroup) -> int:
    """The number of ranks (actors) of `group`."""
    return group.ranks if isinstance(group.ranks, int) else len(group.ranks)


def uses_gpus(group: DeviceGroup) -> bool:
    """Whether `group`'s actors get GPUs: ``device_type`` 'GPU'/'cuda', or None on a cluster
    with GPUs. Raises ``ValueError`` for another device type or too few GPUs in the cluster."""
    device = (group.device_type or "").lower()
    gpus = import_ray().cluster_resources().get("GPU", 0)
    if device not in ("", "cpu", "gpu", "cuda"):
        raise ValueError(
            f"DeviceGroup {group.name!r}: device_type={group.device_type!r} is not supported in "
            "ray mode; use 'GPU', 'CPU' or None (GPUs when the cluster has them)"
        )
    if device == "cpu" or (device == "" and not gpus):
        return False
    needed = group_size(group) * group.gpus_per_worker
    if needed > gpus:
        raise ValueError(
            f"DeviceGroup {group.name!r} needs {needed} GPUs but the Ray cluster has {gpus:g}; "
            "use fewer ranks or device_type='CPU'"
        )
    return True


class RankWorker:
    """One rank of a remote object: the body of a Ray actor (the driver wraps it)."""

    def __init__(self) -> None:
        self._store: dist.TCPStore | None = None
        self._obj: Any = None
        self._iter: Iterator[Any] | None = None

    def rendezvous(self) -> tuple[str, int]:
        """Host the process group's store on a free port of this node; returns (address, port).

        ``multi_tenant``: the process group that `construct` starts on this port reuses this
        server instead of binding the port a second time.
        """
        import ray

        address = ray.util.get_node_ip_address()
        self._store = dist.TCPStore(
            address, 0, is_master=True, wait_for_workers=False, multi_tenant=True
        )
        return address, self._store.port

    def construct(self, env: dict[str, str], backend: str, factory: Callable[[], Any]) -> None:
        """Set this rank's environment, join the process group, build the object."""
        os.environ.update(env)
        init_distributed(backend)
        self._obj = factory()

    def call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The object's method `name` called with `args` and `kwargs`."""
        return getattr(self._obj, name)(*args, **kwargs)

    def start_iter(self) -> None:
        """Start iterating over the object (the iterator stays in this actor)."""
        self._iter = iter(self._obj)

    def next_item(self) -> tuple[bool, Any]:
        """(done, item): the iterator's next item, or (True, None) at its end."""
        try:
            return False, next(self._iter)
        except StopIteration:
            self._iter = None
            return True, None


class ActorGroup:
    """The actors of one remote object: construction, calls, errors, stopping.

    `factory` builds the object in an actor; it runs on `world` actors of `group` (options
    from the group's device type) joined by torch.distributed. Raises what the object's
    constructor raised on some rank (see the module docstring for errors).
    """

    def __init__(
        self, factory: Callable[[], Any], group: DeviceGroup, world: int, mesh: DeviceMesh
    ) -> None:
        ray = import_ray()
        self.name, self.world, self.mesh = group.name, world, mesh
        self.stopped: str | None = None
        gpu = uses_gpus(group)
        options = {"num_cpus": 0, "num_gpus": group.gpus_per_worker if gpu else 0}
        actor_class = ray.remote(RankWorker).options(**options)
        self.actors = [actor_class.remote() for _ in range(world)]
        try:
            self._construct(factory, group.name, "nccl" if gpu else "gloo")
        except Exception:
            if not self.stopped:  # the ranks that did construct are of no use alone
                self.stop("its constructor failed")
            raise

    def _construct(self, factory: Callable[[], Any], name: str, backend: str) -> None:
        """Join the actors into one process group, then build the object in each."""
        address, port = self._get([self.actors[0].rendezvous.remote()], [0], "rendezvous")[0]
        common = {
            "WORLD_SIZE": str(self.world),
            "LOCAL_RANK": "0",  # each actor sees its own GPU(s) only, as upstream's workers
            "MASTER_ADDR": address,
            "MASTER_PORT": str(port),
            "CLUSTER_NAME": name,
            "TWINKLE_MODE": "ray",
        }
        if backend == "gloo":
            common["CUDA_VISIBLE_DEVICES"] = ""
        refs = [
            actor.construct.remote(
                {**common, "RANK": str(r), "WORKER_NAME": f"{name}_{r}"}, backend, factory
            )
            for r, actor in enumerate(self.actors)
        ]
        self._get(refs, list(range(self.world)), "__init__")

    def call(
        self, name: str, spec: RemoteFunctionSpec, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> Any:
        """Method `name` on the ranks `spec` selects, its arguments dispatched and its results
        collected as `spec` says."""
        if spec.execute == "first":
            ranks, calls = [0], [(tuple(args), dict(kwargs))]
        else:  # 'all', and 'peer' (the driver is no rank's peer: every rank runs it)
            ranks = list(range(self.world))
            calls = dispatch_args(spec.dispatch, self.world, self.mesh, args, kwargs)
        refs = [
            self.actors[r].call.remote(name, a, k) for r, (a, k) in zip(ranks, calls, strict=True)
        ]
        results = self._get(refs, ranks, name, spec.timeout)
        return collect_results(spec.collect, results, ranks, self.mesh)

    def iterate(self) -> Iterator[Any]:
        """The items of iterating over rank 0's object, fetched one at a time."""
        self._get([self.actors[0].start_iter.remote()], [0], "__iter__")
        while True:
            done, item = self._get([self.actors[0].next_item.remote()], [0], "__next__")[0]
            if done:
                return
            yield item

    def stop(self, reason: str) -> None:
        """Kill the actors; later calls raise ``RuntimeError`` with `reason`."""
        ray = import_ray()
        for actor in self.actors:
            ray.kill(actor)
        self.stopped = reason

    def _get(
        self, refs: list[Any], ranks: list[int], what: str, timeout: float | None = None
    ) -> list[Any]:
        """The values of `refs` (the calls of `ranks`); the first failure is raised at once."""
        ray = import_ray()
        if self.stopped:
            raise RuntimeError(
                f"the Ray actors of remote group {self.name!r} were stopped ({self.stopped}); "
                "construct the object again"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        values: dict[int, Any] = {}
        pending = list(refs)
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not done:
                self.stop(f"{what} took more than its timeout of {timeout} s")
                raise TimeoutError(f"{what} on remote group {self.name!r} took over {timeout} s")
            index = refs.index(done[0])
            try:
                values[index] = ray.get(done[0])
            except Exception as error:
                error.add_note(
                    f"raised by {what} on rank {ranks[index]} of remote group {self.name!r}"
                )
                self._after_error(pending, what, ranks[index], error)
                raise
        return [values[i] for i in range(len(refs))]

    def _after_error(self, pending: list[Any], what: str, rank: int, error: Exception) -> None:
        """Give the other ranks `ERROR_GRACE_S` to finish; stop the actors if they do not."""
        if not pending:
            return
        _, unfinished = import_ray().wait(pending, num_returns=len(pending), timeout=ERROR_GRACE_S)
        if unfinished:
            self.stop(f"{what} failed on rank {rank} while other ranks waited for it")
            error.add_note(
                f"the other ranks did not finish within {ERROR_GRACE_S:g} s (waiting for rank "
                f"{rank}), so the actors of remote group {self.name!r} were stopped"
            )


def create_handle(
    cls: type, factory: Callable[[], Any], group: DeviceGroup, world: int, mesh: DeviceMesh
) -> Any:
    """A handle of `cls` whose object `factory` builds in `world` actors of `group`."""
    handle = object.__new__(handle_class(cls))
    object.__setattr__(handle, _HANDLE_ATTRIBUTE, ActorGroup(factory, group, world, mesh))
    return handle


def handle_class(cls: type) -> type:
    """The subclass of `cls` whose instances are ray-mode handles (made once per class)."""
    cached = cls.__dict__.get("_twinkle_handle_class")
    if cached is not None:
        return cached
    namespace: dict[str, Any] = {
        "__init__": _handle_init,
        "__getattr__": _missing_attribute,
        "__reduce__": _no_pickle,
        "__repr__": _handle_repr,
        "__doc__": cls.__doc__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "device_mesh": property(lambda self: _actors(self).mesh, doc="The object's mesh."),
        "remote_group": property(lambda self: _actors(self).name, doc="Its DeviceGroup's name."),
    }
    for name, attr in inspect.getmembers_static(cls):
        if name in namespace:
            continue
        if name in ("__len__", "__getitem__"):
            namespace[name] = _remote_method(name, attr, _FIRST)
        elif name == "__iter__":
            namespace[name] = _remote_iter
        elif name.startswith("_"):
            continue
        elif isinstance(attr, property | functools.cached_property):
            namespace[name] = property(_unreadable(name), doc=attr.__doc__)
        elif inspect.isfunction(attr):
            spec = getattr(attr, "__twinkle_remote__", DEFAULT_METHOD_SPEC)
            namespace[name] = _remote_method(name, attr, spec)
    handle = type(cls.__name__, (cls,), namespace)
    cls._twinkle_handle_class = handle
    return handle


def _actors(handle: Any) -> ActorGroup:
    return object.__getattribute__(handle, _HANDLE_ATTRIBUTE)


def _handle_init(self: Any, *args: Any, **kwargs: Any) -> None:
    """The object was built in the actors; the handle itself has nothing to set up."""


def _remote_method(name: str, fn: Callable[..., Any], spec: RemoteFunctionSpec) -> Callable:
    @functools.wraps(fn)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return _actors(self).call(name, spec, args, kwargs)

    return method


def _remote_iter(self: Any) -> Iterator[Any]:
    return _actors(self).iterate()


def _unreadable(name: str) -> Callable[[Any], Any]:
    """A property's handle version: its AttributeError sends Python to `_missing_attribute`."""

    def read(self: Any) -> Any:
        raise AttributeError(name)

    return read


def _missing_attribute(self: Any, name: str) -> Any:
    """Instance attributes and properties (whose handle versions raise) are the object's."""
    raise AttributeError(
        f"{type(self).__name__}.{name} is not readable from a ray-mode handle: the object's "
        "attributes and properties live in its Ray actors; call a method that returns it"
    )


def _no_pickle(self: Any) -> Any:
    raise TypeError(
        f"a ray-mode handle of {type(self).__name__} cannot be pickled or sent to an actor; "
        "use it from the driver"
    )


def _handle_repr(self: Any) -> str:
    actors = _actors(self)
    return (
        f"<{type(self).__name__} handle: {actors.world} Ray actor(s) of group "
        f"{actors.name!r}, {actors.mesh}>"
    )
