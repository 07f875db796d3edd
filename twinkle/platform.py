"""`Platform`: upstream's view of the accelerator and of the launcher's ranks.

Ranks and sizes come from the launcher's environment (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``...) as upstream. The device class is `GPU` with CUDA, `MPS` on Apple silicon,
and, unlike upstream (which falls back to CUDA names), `CPU` on a machine with neither, so that
``Platform.get_local_device()`` names a device that exists.
"""

from __future__ import annotations

import os

import torch


class Platform:
    """Static helpers: the current platform class, ranks, and the local device."""

    @staticmethod
    def get_platform_names() -> list[str]:
        """The platform names `get_platform` takes."""
        return ["GPU", "MPS", "CPU"]

    @staticmethod
    def get_platform(platform: str | None = None) -> type[Platform]:
        """The platform class for `platform` ('GPU'/'CUDA', 'MPS', 'CPU'), or this machine's.

        Raises ``ValueError`` for 'NPU' (Ascend needs torch_npu, not part of this build) and
        unknown names.
        """
        if platform is None:
            if torch.cuda.is_available():
                return GPU
            if torch.backends.mps.is_available():
                return MPS
            return CPU
        name = platform.upper()
        if name in ("GPU", "CUDA"):
            return GPU
        if name == "MPS":
            return MPS
        if name == "CPU":
            return CPU
        if name == "NPU":
            raise ValueError("platform 'NPU' (Ascend) needs torch_npu, which this build lacks")
        raise ValueError(f"Unsupported platform: {platform}.")

    @staticmethod
    def device_prefix(platform: str | None = None) -> str:
        """The torch device type: 'cuda', 'mps' or 'cpu'."""
        return Platform.get_platform(platform).prefix

    @staticmethod
    def visible_device_env(platform: str | None = None) -> str:
        """The environment variable that selects visible devices ('' for CPU)."""
        return Platform.get_platform(platform).visible_env

    @staticmethod
    def device_backend(platform: str | None = None) -> str:
        """The torch.distributed backend: 'nccl' for CUDA, else 'gloo'."""
        return "nccl" if Platform.get_platform(platform) is GPU else "gloo"

    @staticmethod
    def get_local_device(idx: int | None = None, *, platform: str | None = None) -> str:
        """The device of local rank `idx` (default: this process's), e.g. 'cuda:1' or 'cpu'."""
        cls = Platform.get_platform(platform)
        if cls is CPU:
            return "cpu"
        idx = Platform.get_local_rank() if idx is None else idx
        return f"{cls.prefix}:{max(idx, 0)}"

    @staticmethod
    def get_rank() -> int:
        """The global rank (``RANK``), -1 outside a launcher."""
        return int(os.getenv("RANK", -1))

    @staticmethod
    def get_local_rank() -> int:
        """The rank on this node (``LOCAL_RANK``), -1 outside a launcher."""
        return int(os.getenv("LOCAL_RANK", -1))

    @staticmethod
    def get_world_size() -> int:
        """The number of processes (``WORLD_SIZE``), 1 outside a launcher."""
        return int(os.getenv("WORLD_SIZE") or 1)

    @staticmethod
    def get_local_world_size() -> int:
        """The processes on this node (``LOCAL_WORLD_SIZE``), 1 outside a launcher."""
        return int(os.getenv("LOCAL_WORLD_SIZE") or os.getenv("LOCAL_SIZE") or 1)

    @staticmethod
    def get_nnodes() -> int:
        """The node count (``NNODES``)."""
        return int(os.getenv("NNODES", 1))

    @staticmethod
    def get_node_rank() -> int:
        """This node's index (``NODE_RANK``)."""
        return int(os.getenv("NODE_RANK", 0))

    @staticmethod
    def is_local_master() -> bool:
        """Local rank 0, or no launcher."""
        return Platform.get_local_rank() in (-1, 0)

    @staticmethod
    def is_master() -> bool:
        """Global rank 0, or no launcher."""
        return Platform.get_rank() in (-1, 0)

    @staticmethod
    def is_last_rank() -> bool:
        """The last global rank, or no launcher."""
        return Platform.get_rank() in (-1, Platform.get_world_size() - 1)

    @staticmethod
    def get_peer_index(
        target_size: int, rank: int | None = None, world_size: int | None = None
    ) -> slice:
        """This rank's contiguous share of `target_size` workers (one, round-robin, when there
        are fewer workers than ranks)."""
        rank = max(Platform.get_rank() if rank is None else rank, 0)
        world_size = max(Platform.get_world_size() if world_size is None else world_size, 1)
        if target_size < world_size:
            start = rank % target_size
            return slice(start, start + 1)
        k, m = divmod(target_size, world_size)
        return slice(rank * k + min(rank, m), (rank + 1) * k + min(rank + 1, m))


class GPU(Platform):
    """CUDA devices."""

    prefix = "cuda"
    visible_env = "CUDA_VISIBLE_DEVICES"


class MPS(Platform):
    """Apple silicon."""

    prefix = "mps"
    visible_env = ""


class CPU(Platform):
    """No accelerator."""

    prefix = "cpu"
    visible_env = ""
