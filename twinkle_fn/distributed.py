"""Process-group setup: one call that joins torch.distributed from the launcher's environment.

`torchrun`, Ray workers and the test harness all set ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT``; `init_distributed` reads them and picks NCCL when CUDA is present, gloo otherwise.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> int:
    """Join the default process group described by the environment; returns this rank.

    A no-op returning the current rank when the group already exists, and returning 0 when the
    environment names no world (a plain one-process run). `backend` defaults to ``"nccl"`` on a
    CUDA machine (binding this process to ``LOCAL_RANK``'s device) and ``"gloo"`` otherwise.
    Raises ``ValueError`` when ``WORLD_SIZE`` is set without ``RANK``.
    """
    if dist.is_initialized():
        return dist.get_rank()
    if "WORLD_SIZE" not in os.environ:
        return 0
    if "RANK" not in os.environ:
        raise ValueError("WORLD_SIZE is set but RANK is not; launch with torchrun or set both")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank()


def world_size() -> int:
    """The number of ranks in the default group (1 when there is none)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank in the default group (0 when there is none)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def gather_tensors(local: Mapping[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """Every rank's `local` tensors by rank, detached and on the CPU (``all_gather_object``: a
    collective every rank must call; on one process ``{0: ...}`` sharing `local`'s CPU memory).

    Every rank receives every rank's tensors: meant for checks and small models.
    """
    mine = {n: t.detach().cpu() for n, t in local.items()}
    if world_size() == 1:
        return {0: mine}
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, mine)
    return dict(enumerate(gathered))
