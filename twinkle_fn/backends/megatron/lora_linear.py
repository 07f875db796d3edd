"""`LoraParallelLinear`: a megatron-core parallel linear with a LoRA adapter beside it.

The adapter follows the base linear's tensor-parallel layout (a column-parallel base splits
``B``'s rows like its own, a row-parallel one splits ``A``'s columns), so each rank computes
its part of ``x @ (W + scaling * B @ A).T`` with the base linear's own communication.
`ExpertLora` is the adapter of one linear (fc1 or fc2) of every local routed expert of an MoE
layer, which `GroupedSequentialMLP` adds in its grouped GEMMs. `adapters_off` runs a block on the
base weights alone (a reference model's forward). `twinkle_fn.backends.megatron.lora` decides
which linears get one and exports the adapter.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, get_cuda_rng_tracker
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group
from peft import LoraConfig
from torch import Tensor

from twinkle_fn.backends.megatron.bridge import Rule
from twinkle_fn.backends.megatron.bridge_transforms import (
    fuse_gate_up,
    fuse_sections,
    split_gate_up,
    tp_shard,
)
from twinkle_fn.backends.megatron.grouped_experts import grouped_linear
from twinkle_fn.backends.megatron.spec import RowParallelLinear  # no graph break in its forward


class LoraParallelLinear(MegatronModule):
    """``base(x) + scaling * B(A(dropout(x)))`` around a megatron column- or row-parallel linear.

    Takes and returns what the base takes and returns (``(output, bias)``; input
    ``[seq, batch, in]``, sequence-split under sequence parallelism). Column-parallel base
    (output split over tp): ``lora_A`` ``[r, in]`` is replicated, ``lora_B`` a
    ``ColumnParallelLinear`` ``[out / tp, r]`` split like the base, whose input all-reduce in
    backward makes ``A``'s gradient whole on every rank. Row-parallel base (input split):
    ``lora_A`` is a ``RowParallelLinear`` ``[r, in / tp]`` split like the base, whose output is
    all-reduced (reduce-scattered over the sequence under sequence parallelism) before the
    replicated ``lora_B`` ``[out, r]``. Under sequence parallelism the replicated factor sees
    one sequence chunk per rank, so it is marked ``sequence_parallel`` and megatron sums its
    gradient over tp. Dropout on a replicated input draws from the generator every tp rank
    shares, on a split one from megatron's tensor-parallel stream.

    Initialised as peft does, from a generator seeded with `seed` so that every mesh starts
    from the same adapter: ``A`` kaiming-uniform (``init_lora_weights='gaussian'``: normal with
    std ``1 / r``), ``B`` zero (``init_lora_weights=False``: kaiming-uniform like ``A``).
    ``scaling`` is ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``).
    """

    def __init__(self, base: torch.nn.Module, config: LoraConfig, *, rule: Rule, seed: int) -> None:
        super().__init__(config=base.config)
        self.base_layer = base
        self.column = rule.tp_dim == 0
        # megatron fuses [gate; up] per tp rank: a checkpoint stores its rows as two tensors
        self.gate_up = rule.transform == "gate_up"
        mc, r = base.config, config.r
        tp = parallel_state.get_tensor_model_parallel_world_size()
        out_local, in_local = base.weight.shape
        size_in, size_out = (
            (in_local, out_local * tp) if self.column else (in_local * tp, out_local)
        )
        self.scaling = config.lora_alpha / (math.sqrt(r) if config.use_rslora else r)
        self.lora_dropout = (
            torch.nn.Dropout(config.lora_dropout) if config.lora_dropout else torch.nn.Identity()
        )
        parallel = dict(
            config=mc,
            init_method=_filled_below,
            bias=False,
            skip_bias_add=True,
            tp_group=getattr(base, "tp_group", None),
        )
        if self.column:
            self.lora_A = _replicated(size_in, r, mc)
            self.lora_B = ColumnParallelLinear(r, size_out, gather_output=False, **parallel)
        else:
            self.lora_A = RowParallelLinear(size_in, r, input_is_parallel=True, **parallel)
            self.lora_B = _replicated(r, size_out, mc)
        self._init_factors(config, rule, seed, tp)
        for factor in (self.lora_A, self.lora_B):
            factor.to(base.weight.device)
        # `adapters_off` clears it: the forward is then the base layer's alone
        self.enabled = True

    @torch.no_grad()
    def _init_factors(self, config: LoraConfig, rule: Rule, seed: int, tp: int) -> None:
        # Whole factors in the tp=1 layout, then this rank's part, so any tp gives one adapter.
        gen = torch.Generator().manual_seed(seed)
        rank = parallel_state.get_tensor_model_parallel_rank()
        r, size_in = self.lora_A.weight.shape[0], self.lora_A.weight.shape[1]
        a = torch.empty(r, size_in * (1 if self.column else tp))
        if config.init_lora_weights == "gaussian":
            a.normal_(0.0, 1.0 / r, generator=gen)
        else:
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
        b = torch.zeros(self.lora_B.weight.shape[0] * (tp if self.column else 1), r)
        if config.init_lora_weights is False:
            torch.nn.init.kaiming_uniform_(b, a=math.sqrt(5), generator=gen)
        if self.column:
            b = _rows_of_rank(b, rule, rank, tp, self.base_layer.config)
        else:
            a = tp_shard(a, 1, rank, tp)
        self.lora_A.weight.copy_(a)
        self.lora_B.weight.copy_(b)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        """Megatron's sharded state dict of the base layer and the factors; a fused
        ``[gate; up]`` linear's tp-split tensors (the base weight and ``lora_B``) go through
        megatron's SwiGLU factory, as its MLP does for ``linear_fc1.weight``, so a checkpoint
        loads on another tp size."""
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if not self.gate_up:
            return sd
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        singleton = metadata.get("singleton_local_shards", False)
        for name in ("base_layer.weight", "lora_B.weight"):
            sd[prefix + name] = apply_swiglu_sharded_factory(
                sd[prefix + name],
                sharded_offsets,
                singleton,
                tp_group=getattr(self.base_layer, "tp_group", None),
                dp_group=metadata["dp_cp_group"],
            )
        return sd

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        """The base's ``(output, bias)`` with the low-rank update added to the output (the
        base's alone while the adapter is off, see `adapters_off`)."""
        out, bias = self.base_layer(x, *args, **kwargs)
        if not self.enabled:
            return out, bias
        return out + self._update(x), bias

    def _update(self, x: Tensor) -> Tensor:
        split = not self.column or self.config.sequence_parallel  # x differs across tp ranks
        rng = (
            get_cuda_rng_tracker().fork()
            if split and isinstance(self.lora_dropout, torch.nn.Dropout)
            else contextlib.nullcontext()
        )
        with rng:
            x = self.lora_dropout(x)
        # The scale multiplies the rank-r intermediate, not the [tokens, out] update: backward
        # then scales an r-wide gradient instead of writing a scaled copy of the output's.
        if self.column:
            y, _ = self.lora_B(self.lora_A(x) * self.scaling)
        else:
            h, _ = self.lora_A(x)
            y = self.lora_B(h * self.scaling)
        return y


class ExpertLora(torch.nn.Module):
    """``scaling * B_e @ A_e`` beside one linear of each local routed expert ``e``.

    `weights`: the local experts' base weights of that linear (``[out, in]`` each, whole: expert
    tensor parallelism is refused by the caller). ``lora_A`` ``[experts, r, in]`` and ``lora_B``
    ``[experts, out, r]`` stack the local experts' factors; expert ``j`` of this rank is global
    expert ``first_expert + j``, initialised as peft initialises its expert adapters (A
    kaiming-uniform with fan-in ``in``, B zero or, with ``init_lora_weights=False``, like A;
    ``'gaussian'``: A normal with std ``1 / r``) from a generator seeded with
    ``seed * num_experts + global expert``, so every expert-parallel layout starts from the same
    adapter. The factors carry the base weights' ``allreduce`` flag, so megatron's DDP reduces
    their gradients over the expert data-parallel group like the experts'.
    """

    def __init__(
        self,
        weights: list[Tensor],
        config: LoraConfig,
        *,
        seed: int,
        first_expert: int,
        num_experts: int,
    ) -> None:
        super().__init__()
        r = config.r
        out, size_in = weights[0].shape
        self.scaling = config.lora_alpha / (math.sqrt(r) if config.use_rslora else r)
        a = torch.empty(len(weights), r, size_in)
        b = torch.zeros(len(weights), out, r)
        for j in range(len(weights)):
            gen = torch.Generator().manual_seed(seed * num_experts + first_expert + j)
            if config.init_lora_weights == "gaussian":
                a[j].normal_(0.0, 1.0 / r, generator=gen)
            else:
                torch.nn.init.kaiming_uniform_(a[j], a=math.sqrt(5), generator=gen)
            if config.init_lora_weights is False:
                torch.nn.init.kaiming_uniform_(b[j], a=math.sqrt(5), generator=gen)
        like = weights[0]
        self.lora_A = torch.nn.Parameter(a.to(like.device, like.dtype))
        self.lora_B = torch.nn.Parameter(b.to(like.device, like.dtype))
        for factor in (self.lora_A, self.lora_B):
            if hasattr(like, "allreduce"):
                factor.allreduce = like.allreduce  # type: ignore[attr-defined]
        # `adapters_off` clears it: the experts then compute with their base weights alone
        self.enabled = True

    def forward(self, x: Tensor, offs: Tensor) -> Tensor:
        """``[tokens, out]``: the update of each row of `x` ``[tokens, in]`` (sorted by local
        expert, `offs` the cumulative group ends as in `grouped_linear`)."""
        h = grouped_linear(x, offs, list(self.lora_A.unbind(0)))  # [tokens, r]
        # scaled at rank r, as in `LoraParallelLinear._update`
        return grouped_linear(h * self.scaling, offs, list(self.lora_B.unbind(0)))


@contextlib.contextmanager
def adapters_off(modules: Iterable[torch.nn.Module]) -> Iterator[None]:
    """Within the block every `LoraParallelLinear` and `ExpertLora` of `modules` (a rank's
    model chunks) computes its base layer alone: the base weights' outputs, as the model before
    `add_adapters` (a reference model's log-probs without a second copy of the weights). The
    skipped update draws no dropout mask, so megatron's RNG streams advance as without LoRA.
    A no-op on modules without adapters. On several ranks every rank must enter it (each
    switches its own stage's adapters)."""
    kinds = (LoraParallelLinear, ExpertLora)
    layers = [m for c in modules for m in c.modules() if isinstance(m, kinds)]
    for layer in layers:
        layer.enabled = False
    try:
        yield
    finally:
        for layer in layers:
            layer.enabled = True


def _filled_below(weight: Tensor) -> None:
    """Megatron's ``init_method`` for the adapter factors, which `_init_factors` fills."""


def _replicated(size_in: int, size_out: int, mc: Any) -> torch.nn.Linear:
    """A linear replicated over tp; its gradient is summed over tp under sequence parallelism."""
    linear = torch.nn.Linear(size_in, size_out, bias=False, dtype=mc.params_dtype)
    linear.weight.sequence_parallel = mc.sequence_parallel  # type: ignore[attr-defined]
    return linear


def _rows_of_rank(
    full: Tensor, rule: Rule, rank: int, tp: int, config: TransformerConfig
) -> Tensor:
    """Rank `rank`'s rows of a column-parallel tensor given in the tp=1 layout."""
    if rule.transform == "gate_up":  # megatron fuses [gate; up] per rank, not over the whole
        gate, up = split_gate_up(full)
        return fuse_gate_up(tp_shard(gate, 0, rank, tp), tp_shard(up, 0, rank, tp))
    if rule.transform == "gdn_in_proj":  # likewise q, k, v, z, beta, alpha (Gated DeltaNet)
        qk = config.linear_num_key_heads * config.linear_key_head_dim
        v = config.linear_num_value_heads * config.linear_value_head_dim
        heads = config.linear_num_value_heads
        return fuse_sections(full.split([qk, qk, v, v, heads, heads]), rank, tp)
    return tp_shard(full, 0, rank, tp)
