"""The megatron backend's own ``Model.options``, checked, and the ``TransformerConfig`` fields
the rest pass to megatron-core.

`read_options` refuses, before anything is built, the ``TransformerConfig`` fields the mesh and
the backend decide (`FIXED_FIELDS`) and megatron-core's own router losses
(`ROUTER_LOSS_FIELDS`: twinkle computes them, `twinkle_fn.moe`), checks the backend's options
(`OWN_OPTIONS`) and passes every other option through as a ``TransformerConfig`` override.
`twinkle_fn.backends.megatron.backend` describes the options.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

from twinkle_fn.backends.megatron.sharding import vocab_multiple
from twinkle_fn.mesh import Mesh

OWN_OPTIONS = (
    "num_micro_batches",
    "vocab_multiple",
    "use_te",
    "grouped_experts",
    "lora",
    "lora_name",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "grad_bucket_size",
    "compile_layers",
    "fp8",
    "fp8_store_frozen",
    "router_loss",
)
# megatron-core's own router losses: twinkle computes them (`twinkle_fn.moe`, the option
# router_loss), the same on both backends, so megatron's stay off.
ROUTER_LOSS_FIELDS = MappingProxyType(
    dict(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None)
)
# TransformerConfig fields the mesh or this backend's loss and gradient handling decide.
FIXED_FIELDS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "sequence_parallel",
    "calculate_per_token_loss",
    "finalize_model_grads_func",
    "bf16",
    "fp16",
)


class Options(NamedTuple):
    """The backend's options of one model, checked (`read_options`); ``overrides``: the
    ``TransformerConfig`` fields the other options set."""

    num_micro_batches: int
    vocab_multiple: int
    use_te: bool | None
    grouped_experts: bool
    overrides: dict[str, Any]  # TransformerConfig fields
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    grad_bucket_size: int | None


def read_options(options: Mapping[str, Any], mesh: Mesh) -> Options:
    """The backend's own options in `options` (a model's ``Model.options``), checked, and the
    ``TransformerConfig`` overrides (every other option); ``num_micro_batches`` defaults to
    ``mesh.pp``. Raises ``ValueError`` naming the option for a field the mesh or the backend
    sets (`FIXED_FIELDS`), megatron-core's own router losses (`ROUTER_LOSS_FIELDS`), or an own
    option of the wrong type or range."""
    fixed = sorted(set(options) & set(FIXED_FIELDS))
    if fixed:
        raise ValueError(
            f"option(s) {', '.join(fixed)} are set by the mesh and the megatron backend (tp, pp, "
            "cp, ep, etp and sequence_parallel from twinkle_fn.Mesh, precision from the model; "
            "virtual pipeline parallelism is not supported yet); drop them from the options"
        )
    native = sorted(set(options) & set(ROUTER_LOSS_FIELDS))
    if native:
        raise ValueError(
            f"option(s) {', '.join(native)} would turn on megatron-core's own router losses; "
            "set option router_loss={'aux_coef': ..., 'aux_kind': 'hf' | 'megatron', "
            "'z_coef': ...} instead (twinkle_fn.moe.RouterLoss: the same on both backends)"
        )
    overrides = {k: v for k, v in options.items() if k not in OWN_OPTIONS}
    num = options.get("num_micro_batches", mesh.pp)
    if isinstance(num, bool) or not isinstance(num, int) or num < 1:
        raise ValueError(f"option num_micro_batches must be a positive int, got {num!r}")
    multiple = vocab_multiple(options)
    overlap = options.get("overlap_grad_reduce", True)
    gather = options.get("overlap_param_gather", False)
    grouped = options.get("grouped_experts", True)
    for name, value in (
        ("overlap_grad_reduce", overlap),
        ("overlap_param_gather", gather),
        ("grouped_experts", grouped),
    ):
        if not isinstance(value, bool):
            raise ValueError(f"option {name} must be a bool, got {value!r}")
    bucket_size = options.get("grad_bucket_size")
    if bucket_size is not None and (
        isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 1
    ):
        raise ValueError(f"option grad_bucket_size must be a positive int, got {bucket_size!r}")
    use_te = options.get("use_te")
    return Options(num, multiple, use_te, grouped, overrides, overlap, gather, bucket_size)
