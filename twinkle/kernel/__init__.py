"""Upstream's kernel replacement API: ``kernelize(model, mapping)`` with the bundles
``npu_builtin(model)`` (Ascend NPU kernels) and ``liger_builtin(model)`` (Liger Kernel).

Upstream's scripts build a mapping from the bundles that apply and kernelize only when it is
non-empty. This build computes with the core's own kernels (its fused cross entropy on CUDA,
torch elsewhere) and ships neither bundle: asking for one says which package it needs, and
`kernelize` of an empty mapping returns the model unchanged.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any


def _missing(bundle: str, package: str, why: str) -> ValueError:
    installed = importlib.util.find_spec(package) is not None
    state = "is installed, but" if installed else "is not installed, and"
    return ValueError(
        f"{bundle}: the {package} package {state} this build has no {why} kernels to map; "
        "run without it (the core's kernels are used), e.g. drop --enable-liger"
    )


def npu_builtin(model: Any = None) -> dict[Any, Any]:
    """Upstream's Ascend NPU kernel bundle. Raises ``ValueError``: this build has no NPU
    kernels (nor ``torch_npu``); upstream's scripts call it only when an NPU is present."""
    raise _missing("npu_builtin", "torch_npu", "Ascend NPU")


def liger_builtin(model: Any = None) -> dict[Any, Any]:
    """Upstream's Liger Kernel bundle (``--enable-liger``). Raises ``ValueError``: this build
    maps no Liger kernels (and ``liger_kernel`` is not one of its dependencies)."""
    raise _missing("liger_builtin", "liger_kernel", "Liger")


def kernelize[M](model: M, mapping: Mapping[Any, Any]) -> M:
    """`model` with the kernels of `mapping` swapped in: an empty mapping returns `model`
    unchanged. Raises ``ValueError`` for a non-empty mapping (this build replaces no kernels;
    naming what it was asked to replace)."""
    if not mapping:
        return model
    targets = ", ".join(sorted(map(str, mapping))[:5])
    raise ValueError(
        f"kernelize: this build replaces no kernels, and the mapping asks for {len(mapping)} "
        f"({targets}); pass an empty mapping (the core's kernels are used)"
    )


__all__ = ["kernelize", "liger_builtin", "npu_builtin"]
