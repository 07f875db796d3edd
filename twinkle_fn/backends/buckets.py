"""Size-bounded buckets of named tensors: how weights leave a trainer (`twinkle_fn.export`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

Bucket = list[tuple[str, torch.Tensor]]


def nbytes(tensor: torch.Tensor) -> int:
    """The bytes of `tensor`'s elements (not of its storage, which a view may exceed)."""
    return tensor.numel() * tensor.element_size()


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`module`'s persistent buffers by name: checkpoint tensors that are not trained (a
    router's expert bias), which an export carries beside the parameters.

    Read from each submodule's buffers, not from ``state_dict()``: FSDP2's state-dict hooks
    reshard parameters, which would free the storage of views already handed out.
    """
    return {
        f"{prefix}.{name}" if prefix else name: buf
        for prefix, sub in module.named_modules()
        for name, buf in sub.named_buffers(recurse=False)
        if buf is not None and name not in sub._non_persistent_buffers_set
    }


def buckets(named: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[Bucket]:
    """Consecutive groups of `named`, each of at most `max_bytes` (a larger tensor goes alone).

    Lazy: a bucket is yielded as soon as the next tensor would overflow it, so at most one
    bucket and the next tensor of `named` are alive here. Raises ``ValueError`` (eagerly) if
    `max_bytes` < 1.
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
    return _buckets(named, max_bytes)


def _buckets(named: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[Bucket]:
    bucket: Bucket = []
    size = 0
    for name, tensor in named:
        n = nbytes(tensor)
        if bucket and size + n > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += n
    if bucket:
        yield bucket
