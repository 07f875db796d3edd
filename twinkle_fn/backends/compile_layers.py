"""The model option ``compile_layers``: ``torch.compile`` each decoder layer in place."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def compile_layers(layers: Iterable[torch.nn.Module], setting: object) -> None:
    """``torch.compile`` each of `layers` in place when `setting` (the value of the option) is
    ``True`` or a dict of ``torch.compile`` arguments; ``False`` leaves them eager. A layer
    compiled already is kept.

    One graph per layer (not one for the model): identical layers share the compiled code, and
    the backends' hooks between layers (FSDP2's gathers, megatron's gradient buckets) stay
    outside the graphs. Raises ``TypeError`` for another `setting`.
    """
    if setting is False:
        return
    if setting is not True and not isinstance(setting, dict):
        raise TypeError(
            f"option compile_layers must be True, False or a dict of torch.compile arguments, "
            f"got {setting!r}"
        )
    kwargs = {} if setting is True else setting
    for layer in layers:
        if getattr(layer, "_compiled_call_impl", None) is None:
            layer.compile(**kwargs)
