"""Backends: how a `Model` is placed, run forward/backward and updated (see `base.Backend`)."""

from __future__ import annotations

import importlib

from twinkle_fn.backends.base import Backend

# name -> (module, attribute); imported on first use so megatron-core loads only when needed.
_REGISTRY = {
    "fsdp": ("twinkle_fn.backends.transformers_backend", "TransformersBackend"),
    "megatron": ("twinkle_fn.backends.megatron", "MegatronBackend"),
}


def names() -> tuple[str, ...]:
    """The names of the known backends."""
    return tuple(_REGISTRY)


def get(name: str) -> Backend:
    """The backend called `name`. Raises ``ValueError`` listing the known ones."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(_REGISTRY)}")
    module, attr = _REGISTRY[name]
    return getattr(importlib.import_module(module), attr)()
