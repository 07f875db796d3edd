"""Run a function on N real processes joined by gloo: the multi-rank test harness.

`spawn(fn, world_size, *args)` starts `world_size` processes, initialises torch.distributed in
each (gloo, on a free loopback port) and returns the per-rank return values in rank order. A
failure on any rank is re-raised in the caller with that rank's traceback.

On a CPU-only machine ranks are forked from a fork server that imported twinkle_fn and its
dependencies once (per calling process): a fresh interpreter per rank spent ~5 s of CPU on those
imports before its first line of test code, most of a tiny-model test's time on a 2-core CI
runner. Forking from the server, not from the caller, keeps each rank free of the caller's state
(process group, patched modules, threads), as a spawned interpreter was.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_module
import random
import socket
import traceback
from collections.abc import Callable
from typing import Any

import numpy
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Below Linux's ephemeral range (32768-60999), so the port is not handed out to some outgoing
# connection (other tests' gloo sockets) between this check and the rendezvous binding it.
_PORTS = range(20000, 32000)
_ATTEMPTS = 3
# What ranks import anyway: the harness (twinkle_fn), the test modules' pytest, the facade, the
# transformers backend, and torch's inductor and C++ extension modules, most of megatron-core's
# import time. Not megatron-core itself: importing it changes how every tensor pickles
# (``megatron.core.safe_globals``), which a transformers-only rank must not inherit.
_PRELOAD = (
    "twinkle_fn.testing_dist",
    "twinkle_fn.backends.transformers.backend",
    "twinkle",
    "pytest",
    "torch._inductor.compile_fx",
    "torch.utils.cpp_extension",
)


def free_port() -> int:
    """A TCP port on the loopback interface that is free now (outside the ephemeral range)."""
    for port in random.sample(_PORTS, 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free loopback port in 20000-32000")


def spawn(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 180.0
) -> list[Any]:
    """Call ``fn(*args)`` on `world_size` gloo ranks; return the results in rank order.

    `fn` must be importable by name (a module-level function) and its results picklable. Each
    process sees ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``.
    A rendezvous port taken by someone else in the meantime is retried on a new port. Raises
    ``RuntimeError`` carrying the first failing rank's traceback.
    """
    for _ in range(_ATTEMPTS - 1):
        try:
            return _spawn_once(fn, world_size, args, timeout_s)
        except _PortTaken:
            continue
    return _spawn_once(fn, world_size, args, timeout_s)


class _PortTaken(RuntimeError):
    """The rendezvous port was taken between choosing it and binding it."""


def _spawn_once(
    fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], timeout_s: float
) -> list[Any]:
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, port, queue, args, dict(os.environ)),
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in procs:
            try:
                rank, ok, value = queue.get(timeout=timeout_s)
            except queue_module.Empty:
                raise RuntimeError(
                    f"no result from some of {world_size} ranks in {timeout_s}s"
                ) from None
            if not ok:
                # The other ranks may be stuck in a collective waiting for this one: stop them.
                error = _PortTaken if "EADDRINUSE" in value else RuntimeError
                raise error(f"rank {rank} of {world_size} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            if p.is_alive() and len(results) < world_size:
                p.kill()
            p.join()
    return [results[r] for r in range(world_size)]


def _context() -> Any:
    """The multiprocessing context `spawn` starts ranks in: on a CPU-only machine a fork server
    with the imports every rank needs done once (a process it starts gets the server's
    environment; `spawn` hands each rank the caller's). A CUDA machine keeps a fresh interpreter
    per rank: an import in the server that queried the CUDA driver would leave forked ranks a
    driver they cannot use."""
    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


def _worker(fn, rank, world_size, port, queue, args, environ) -> None:
    os.environ.clear()
    os.environ.update(environ)
    # A fresh interpreter seeds torch's and numpy's generators from the OS; a forked rank would
    # share the server's states with every other rank (Python's `random` reseeds itself).
    torch.seed()
    numpy.random.seed()
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120)
        )
        # Pickle here, not in the queue's feeder thread, where an error would be lost.
        queue.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
