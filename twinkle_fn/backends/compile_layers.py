"""The model option ``compile_layers``: ``torch.compile`` each decoder layer in place.

Inductor's min-cut partitioner decides what a compiled layer saves for backward. By default it
never recomputes a value that backward has to write to memory anyway (an input of a matmul
there): recomputing it costs that write. Within a decoder layer those values are the norms'
outputs (the qkv and fc1 matmuls' inputs) and the SwiGLU product (fc2's input), and saving them
costs memory: at 0.5B, batch 8, seq 2048 the SwiGLU products alone are 3.6 GiB. The layers are
compiled with `RecomputingPartitioner`, which lets the partitioner rebuild them in backward from
what it keeps (the fc1 output, the residual stream): a pointwise kernel each, fused into the
backward kernels that read those inputs anyway. A ``memory_budget`` below 1 trades more
recompute (matmuls, attention) for memory, layer by layer: activation checkpointing's trade,
at a finer grain (at 1.5B on an H200, budget 0.6 held 25.4 GiB at 40.9% MFU where
checkpointing every layer held 24.0 GiB at 35.4%; `benchmarks/RESULTS.md`).

``{"mode": "reduce-overhead"}`` also captures each layer in CUDA graphs, which removes the
kernels' launch cost from the host; it pays only where the host, not the GPU, bounds the step
(a Qwen3-4B LoRA step on an H200 went from 276 to 183 ms of host time, its ~290 ms unchanged).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch._functorch.config as functorch_config
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor import list_mode_options
from torch._inductor.custom_graph_pass import CustomPartitionerFn


class RecomputingPartitioner(CustomPartitionerFn):
    """Inductor's min-cut partitioner, allowed to recompute values that backward materialises.

    The same partition as inductor's own (``min_cut_rematerialization_partition``) but with
    ``ban_recompute_materialized_backward`` off, for this partition only: pointwise results
    that a backward matmul reads (norm outputs, the SwiGLU product) are recomputed from saved
    inputs instead of saved. Reductions (the norms' statistics) are still saved, so the
    recomputed values are the forward's, bit for bit.

    `memory_budget` (torch's ``activation_memory_budget``, in ``[0, 1]``): the fraction of the
    runtime-optimal partition's saved bytes a layer may keep; below 1 the partitioner also
    recomputes matmuls and attention, the cheapest per byte first (0: the layer's inputs
    only, as with activation checkpointing). Raises ``ValueError`` outside ``[0, 1]``.
    """

    def __init__(self, memory_budget: float = 1.0) -> None:
        if not 0.0 <= memory_budget <= 1.0:
            raise ValueError(f"memory_budget must be in [0, 1], got {memory_budget}")
        self.memory_budget = float(memory_budget)

    def __call__(
        self, gm: torch.fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        """Split the joint graph `gm` into forward and backward graphs (see the class)."""
        with functorch_config.patch(
            ban_recompute_materialized_backward=False,
            activation_memory_budget=self.memory_budget,
        ):
            return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)

    def uuid(self) -> str:
        """Key of this partitioner in inductor's caches."""
        return f"{type(self).__qualname__}-v1-{self.memory_budget!r}"


def compile_arguments(setting: object) -> dict[str, Any]:
    """``torch.compile`` arguments for the option's `setting`: ``True`` or a dict of them,
    which may also hold ``"memory_budget"`` (see `RecomputingPartitioner`; default 1).

    With inductor (the default backend), ``RecomputingPartitioner(memory_budget)`` is added to
    the inductor options unless the setting names a partitioner of its own; a ``mode`` is
    expanded into its options (inductor takes either, not both). Raises ``TypeError`` for
    another `setting`, ``ValueError`` for a ``memory_budget`` outside ``[0, 1]`` or with
    another backend or partitioner.
    """
    if setting is not True and not isinstance(setting, dict):
        raise TypeError(
            f"option compile_layers must be True, False or a dict of torch.compile arguments, "
            f"got {setting!r}"
        )
    kwargs = {} if setting is True else dict(setting)
    budget = kwargs.pop("memory_budget", None)
    options = kwargs.get("options", {})
    if kwargs.get("backend", "inductor") != "inductor" or "custom_partitioner_fn" in options:
        if budget is not None:
            raise ValueError(
                "compile_layers' memory_budget sets inductor's partitioner; drop it, or the "
                "backend / custom_partitioner_fn that replaces that partitioner"
            )
        return kwargs
    mode = kwargs.pop("mode", None)
    partitioner = RecomputingPartitioner(1.0 if budget is None else budget)
    mode_options = list_mode_options(mode) if mode else {}
    kwargs["options"] = {**mode_options, **options, "custom_partitioner_fn": partitioner}
    return kwargs


def compile_layers(layers: Iterable[torch.nn.Module], setting: object) -> None:
    """``torch.compile`` each of `layers` in place when `setting` (the value of the option) is
    ``True`` or a dict of ``torch.compile`` arguments (see `compile_arguments`); ``False``
    leaves them eager. A layer compiled already is kept.

    One graph per layer (not one for the model): identical layers share the compiled code, and
    the backends' hooks between layers (FSDP2's gathers, megatron's gradient buckets) stay
    outside the graphs. Raises ``TypeError`` for another `setting`.
    """
    if setting is False:
        return
    kwargs = compile_arguments(setting)
    for layer in layers:
        if getattr(layer, "_compiled_call_impl", None) is None:
            layer.compile(**kwargs)
