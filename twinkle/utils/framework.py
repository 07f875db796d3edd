"""Upstream's ``twinkle.utils.framework.Torch``: which accelerator this process has.

Upstream's scripts branch on it (``if Torch.is_npu_available(): ...``). An Ascend NPU needs the
``torch_npu`` package, which this build neither ships nor needs: without it there is no NPU.
"""

from __future__ import annotations

import importlib.util
import random

import numpy as np
import torch


class Torch:
    """Device queries and helpers for torch, as upstream's class of that name."""

    @staticmethod
    def is_torch_available() -> bool:
        """Always True here (torch is a dependency)."""
        return True

    @staticmethod
    def is_torch_npu_available() -> bool:
        """Whether ``torch_npu`` (Ascend's torch extension) is installed."""
        return importlib.util.find_spec("torch_npu") is not None

    @staticmethod
    def is_npu_available() -> bool:
        """Whether an Ascend NPU is usable: ``torch_npu`` installed and a device present."""
        if not Torch.is_torch_npu_available():
            return False
        importlib.import_module("torch_npu")
        npu = getattr(torch, "npu", None)
        return bool(npu is not None and npu.is_available())

    @staticmethod
    def is_gpu_available() -> bool:
        """Whether a CUDA GPU is usable."""
        return torch.cuda.is_available()

    @staticmethod
    def get_device(local_rank: int | str | None = None) -> str:
        """``'cuda:<local_rank>'`` (``'npu:...'`` on Ascend), else ``'cpu'``."""
        index = 0 if local_rank is None else int(local_rank)
        if Torch.is_gpu_available():
            return f"cuda:{index}"
        if Torch.is_npu_available():
            return f"npu:{index}"
        return "cpu"

    @staticmethod
    def synchronize() -> None:
        """Wait for this process's queued device work (nothing to wait for on CPU)."""
        if Torch.is_gpu_available():
            torch.cuda.synchronize()

    @staticmethod
    def empty_cache() -> None:
        """Return cached device memory to the driver (nothing on CPU)."""
        if Torch.is_gpu_available():
            torch.cuda.empty_cache()

    @staticmethod
    def seed_everything(seed: int = 42, deterministic: bool = False) -> None:
        """Seed python's, numpy's and torch's generators with `seed`; with `deterministic`,
        make torch pick deterministic kernels (raising where an op has none)."""
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        if deterministic:
            torch.use_deterministic_algorithms(True)
