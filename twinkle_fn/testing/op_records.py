"""`op_shapes`: the output shapes of one aten op while a block runs (a backward, typically).

Tests use it to pin down what a computation materialises, where the bytes it moves are the
point (a scaled copy of an output-sized gradient, say) and the values alone cannot tell.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _Recorder(TorchDispatchMode):
    def __init__(self, packet: Any, shapes: list[tuple[int, ...]]) -> None:
        super().__init__()
        self.packet, self.shapes = packet, shapes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is self.packet and isinstance(out, torch.Tensor):
            self.shapes.append(tuple(out.shape))
        return out


@contextlib.contextmanager
def op_shapes(packet: Any) -> Iterator[list[tuple[int, ...]]]:
    """Within the block, each call of aten op `packet` (an overload packet such as
    ``torch.ops.aten.mul``) appends its output's shape to the yielded list, in call order."""
    shapes: list[tuple[int, ...]] = []
    with _Recorder(packet, shapes):
        yield shapes
