"""LoRA on megatron-core's parallel linears (the megatron backend), exported as a peft adapter.

`add_lora` puts a ``peft.LoraConfig`` into a megatron model's ``options["lora"]``; when the
backend places the model (``tf.init``), `add_adapters` wraps the selected linears of each rank's
``GPTModel`` stage in `LoraParallelLinear` and freezes every other parameter, after the base
weights are loaded and before megatron's DDP and optimizer are built: the DDP grad buffers, the
train state and the distributed optimizer hold the adapters only.

Targets are named as on the HF model (peft's ``target_modules``, ``exclude_modules``,
``layers_to_transform``; ``"all-linear"`` = every linear below, never the lm_head):

=============================  ===============================  ==============================
megatron linear                HF modules                        parallel layout
=============================  ===============================  ==============================
self_attention.linear_qkv      q_proj, k_proj, v_proj (fused)   column: B split like the base
self_attention.linear_proj     o_proj                           row: A split like the base
mlp.linear_fc1                 gate_proj, up_proj (fused)       column
mlp.linear_fc2                 down_proj                        row
mlp.shared_experts.linear_fc1  shared expert's gate/up (fused)  column
mlp.shared_experts.linear_fc2  shared expert's down_proj        row
mlp.experts (fc1, fc2)         experts.gate_up_proj, down_proj  whole per expert (etp 1), over ep
=============================  ===============================  ==============================

Multi-latent attention (`twinkle_fn.backends.megatron.mla`) takes adapters on every linear of
`MLA_LINEARS` instead of ``linear_qkv``: ``q_a_proj``, ``q_b_proj`` (or ``q_proj``),
``kv_a_proj_with_mqa``, ``kv_b_proj``, all column-parallel (the down projections' rows split
like their base weights; their outputs are gathered), and ``o_proj`` as above.

Routed experts are targeted as peft 0.17+ targets transformers 5's fused experts,
``target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]`` (``"all-linear"``
includes both, see `twinkle_fn.lora.resolve_moe_targets`): one adapter per expert and linear
(`ExpertLora`, added by `GroupedSequentialMLP`'s grouped GEMMs), exported in peft's
``ParamWrapper`` layout (``lora_A`` ``[r * experts, in]`` expert-major, ``lora_B``
``[out, r * experts]`` rank-major), gathered over the expert-parallel ranks.

A fused linear gets one adapter: one ``A`` shared by its parts and one ``B`` laid out like the
base weight (q/k/v rows interleaved per query group, ``[gate; up]`` per tp rank). A config that
selects only some parts of a fused linear (``q_proj`` without ``k_proj``) is refused: the update
of the unselected parts would have to be pinned at zero. The exported adapter gives each part
its rows of ``B`` and a copy of ``A``, which is the same update, so peft applies it exactly.

The HF / megatron naming and the fused layouts come from the bridge's rules and transforms
(`twinkle_fn.backends.megatron.bridge`); parameter names are megatron's with ``base_layer``, ``lora_A``,
``lora_B`` inserted (``decoder.layers.0.self_attention.linear_qkv.lora_A.weight``).

Not supported (refused with an error naming the field): routers and shared-expert gates, expert
LoRA under expert tensor parallelism (etp > 1) or on experts that run megatron's loop, DoRA,
trained biases, ``modules_to_save``, per-module ``rank_pattern`` / ``alpha_pattern``,
initialisations that rewrite the base weights. ``"all-linear"`` on a model whose first dense
MLPs share their linears' names with its experts (GLM-4 MoE) leaves those MLPs out (see
`resolve`).

This module is the backend's entry (`add_lora`) and re-exports the parts: which linears take
adapters (`lora_targets`), building them on a placed model (`lora_adapters`) and the peft
export (`lora_peft`); the adapted linears themselves are `lora_linear`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from peft import LoraConfig

from twinkle_fn.backends.megatron.lora_adapters import add_adapters
from twinkle_fn.backends.megatron.lora_peft import (
    adapter_config,
    adapter_state_dict,
    expert_factor_name,
    expert_factors_to_peft,
    save_adapter,
)
from twinkle_fn.backends.megatron.lora_targets import (
    EXPERT_LINEARS,
    GDN_LINEARS,
    LINEARS,
    MLA_LINEARS,
    SHARED,
    LoraPlan,
    layer_linears,
    lora_config,
    resolve,
)
from twinkle_fn.models.model import Model

__all__ = [
    "EXPERT_LINEARS",
    "GDN_LINEARS",
    "LINEARS",
    "MLA_LINEARS",
    "SHARED",
    "LoraPlan",
    "adapter_config",
    "adapter_names",
    "adapter_state_dict",
    "add_adapters",
    "add_lora",
    "expert_factor_name",
    "expert_factors_to_peft",
    "layer_linears",
    "lora_config",
    "resolve",
    "save_adapter",
]


def add_lora(
    model: Model, config: LoraConfig | Mapping[str, Any], adapter_name: str = "default"
) -> Model:
    """`model` (megatron backend, not yet placed) set to train LoRA adapter `adapter_name` of
    `config` only.

    Checks `config` against the model (see `resolve`) and returns a copy of `model` whose
    ``options["lora"]`` is a private copy of it (and ``options["lora_name"]`` the name);
    ``tf.init`` then builds the adapters (see `add_adapters`). Building the model with
    ``options={"lora": config}`` is the same, checked at ``tf.init``. Raises ``ValueError`` for
    a model of another backend, one already placed or with a LoRA config (one adapter per
    model), an empty name or one holding a ``.``, and as `resolve` does.
    """
    if model.backend != "megatron":
        raise ValueError(
            f"this model runs on the {model.backend!r} backend; use twinkle_fn.lora.add_lora"
        )
    if model.placement is not None:
        raise ValueError(
            "this model is already placed; add adapters before tf.init (add_lora on the model, "
            "then tf.init(model, tx, mesh))"
        )
    if not isinstance(adapter_name, str) or not adapter_name or "." in adapter_name:
        raise ValueError(f"adapter_name must be a non-empty str without '.', got {adapter_name!r}")
    if model.options.get("lora") is not None:
        raise ValueError(
            f"this model already has a LoRA config (adapter {adapter_names(model)}); the "
            "megatron backend trains one adapter per model: build another model for another one"
        )
    resolve(config, model.module)
    options = {**model.options, "lora": lora_config(config), "lora_name": adapter_name}
    return dataclasses.replace(model, options=options)


def adapter_names(model: Model) -> list[str]:
    """The model's one adapter name (``options["lora_name"]``, default ``"default"``), or
    none."""
    if model.options.get("lora") is None:
        return []
    return [model.options.get("lora_name", "default")]
