"""Backends: how a `Model` is placed, run forward/backward and updated (see `base.Backend`).

Each backend is one package (`transformers`: FSDP2/DTensor over an HF module; `megatron`:
megatron-core) reached only through `get`; its modules are imported on first use, so
megatron-core loads only when a megatron model is built.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> (module, attribute)
_REGISTRY = {
    "transformers": ("twinkle_fn.backends.transformers.backend", "TransformersBackend"),
    "megatron": ("twinkle_fn.backends.megatron.backend", "MegatronBackend"),
}
# Names earlier releases used, still accepted where a backend is named.
_ALIASES = {"fsdp": "transformers"}


def names() -> tuple[str, ...]:
    """The names of the known backends."""
    return tuple(_REGISTRY)


def canonical(name: str) -> str:
    """`name`, or the backend it is an older name of. Raises ``ValueError`` for an unknown name,
    listing the known ones."""
    name = _ALIASES.get(name, name)
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(_REGISTRY)}")
    return name


def get(name: str) -> Any:
    """The backend called `name`, a `twinkle_fn.backends.base.Backend` (the registry imports
    none of the core's types, so the modules it serves may import it). Raises ``ValueError``
    listing the known ones."""
    module, attr = _REGISTRY[canonical(name)]
    return getattr(importlib.import_module(module), attr)()
