"""megatron-core's ``TransformerConfig`` derived from an HF config and a `Mesh`.

One function per concern: `transformer_config` maps the architecture (GQA, RMSNorm, SwiGLU, q/k
norm, qkv bias, MoE router and experts) and the parallel sizes (Megatron's vocabulary padding is
`twinkle_fn.backends.megatron.bridge_transforms.padded_vocab_size`). Rotary embeddings and tied embeddings are ``GPTModel`` arguments, not config
fields: `twinkle_fn.backends.megatron.model` sets them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer import MLATransformerConfig, TransformerConfig
from transformers import PretrainedConfig

from twinkle_fn.backends.megatron import gated_delta_net
from twinkle_fn.backends.megatron.bridge_rules import megatron_family
from twinkle_fn.backends.megatron.mla import mla_fields
from twinkle_fn.mesh import Mesh
from twinkle_fn.models.families import Family, Moe, flag_on


def _require_divides(size: int, axis: str, count: int, what: str) -> None:
    if count % size:
        raise ValueError(
            f"{axis}={size} does not divide the {count} {what} of this model; "
            f"use a {axis} that divides {count}"
        )


def _moe_fields(hf_config: PretrainedConfig, fam: Family, mesh: Mesh) -> dict[str, Any]:
    moe = fam.moe
    experts, ffn = getattr(hf_config, moe.num_experts), getattr(hf_config, moe.ffn)
    _require_divides(mesh.ep, "ep", experts, "experts")
    _require_divides(mesh.etp, "etp", ffn, "expert MLP channels")
    layers = set(fam.moe_layers(hf_config))
    pattern = [int(i in layers) for i in range(hf_config.num_hidden_layers)]
    aux = bool(getattr(hf_config, "output_router_logits", False))
    shared: dict[str, Any] = {}
    if moe.shared is not None:
        shared_ffn = moe.shared.size(hf_config)
        _require_divides(mesh.tp, "tp", shared_ffn, "shared expert MLP channels")
        shared = dict(
            moe_shared_expert_intermediate_size=shared_ffn,
            moe_shared_expert_gate=moe.shared.gate is not None,
        )
    return dict(
        **shared,
        **_router_fields(hf_config, moe),
        num_moe_experts=experts,
        moe_layer_freq=pattern if 0 in pattern else 1,
        moe_router_topk=getattr(hf_config, moe.top_k),
        moe_ffn_hidden_size=ffn,
        # HF: softmax over all experts, top-k, then renormalise iff norm_topk_prob. Megatron's
        # pre_softmax=False (softmax over the top-k logits) is exactly the renormalised form.
        moe_router_pre_softmax=not flag_on(moe.renormalize, hf_config),
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if aux else "none",
        moe_aux_loss_coeff=float(hf_config.router_aux_loss_coef) if aux else 0.0,
        moe_grouped_gemm=False,
    )


def _router_fields(hf_config: PretrainedConfig, moe: Moe) -> dict[str, Any]:
    """megatron's router settings for a sigmoid router, an expert bias, expert groups and a
    scaling factor (`Moe`'s scoring fields); {} for a plain softmax router. Raises
    ``ValueError`` for what megatron's router computes differently from HF's."""
    fields: dict[str, Any] = {"moe_router_score_function": moe.score}
    top_k = getattr(hf_config, moe.top_k)
    if moe.score == "sigmoid" and top_k > 1 and not flag_on(moe.renormalize, hf_config):
        raise ValueError(
            f"{_source(moe.renormalize, 'renormalize')}=False with a sigmoid router is not "
            "supported: megatron-core always renormalises sigmoid top-k weights to sum to 1; "
            f"set {_source(moe.renormalize, 'renormalize')}=True or use backend='transformers'"
        )
    if moe.expert_bias is not None:
        # HF keeps the bias as loaded (a buffer); megatron would move it after every step
        # towards balanced loads. Rate 0 keeps it, so both backends train the same model.
        fields.update(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0)
    groups = getattr(hf_config, moe.groups) if moe.groups is not None else 1
    if groups > 1:
        chosen = getattr(hf_config, moe.group_topk)
        if top_k // chosen != 2:
            # HF scores a group by its top 2 experts, megatron by its top (top_k // groups chosen)
            raise ValueError(
                f"{moe.top_k}={top_k} with {moe.group_topk}={chosen} is not supported: "
                "megatron-core scores an expert group by its top "
                f"{moe.top_k} // {moe.group_topk} experts and HF by its top 2; use values with "
                f"{moe.top_k} == 2 * {moe.group_topk}, {moe.groups}=1, or backend='transformers'"
            )
        fields.update(moe_router_num_groups=groups, moe_router_group_topk=chosen)
    if moe.scale is not None:
        fields["moe_router_topk_scaling_factor"] = float(getattr(hf_config, moe.scale))
    return fields


def _linear_bias(hf_config: PretrainedConfig, fam: Family) -> bool:
    """Whether o_proj and the MLP carry biases (megatron's ``add_bias_linear``)."""
    attn, mlp = fam.has_bias("o", hf_config), fam.has_bias("mlp", hf_config)
    if attn != mlp or (attn and fam.moe is not None):
        # megatron has one switch for o_proj and every MLP linear (experts included).
        raise ValueError(
            f"{_source(fam.o_bias, 'o_proj bias')}={attn} with "
            f"{_source(fam.mlp_bias, 'MLP bias')}={mlp} is not supported for {fam.name}: "
            "megatron-core biases o_proj and the MLP together; set both to the same value "
            "(False for mixture-of-experts models)"
        )
    return attn


def _source(flag: bool | str, what: str) -> str:
    """The config field that sets `flag`, else `what` (a bias the family fixes)."""
    return flag if isinstance(flag, str) else what


def _check_supported(hf_config: PretrainedConfig) -> None:
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported; twinkle's Megatron models use silu")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError(
            "use_sliding_window=True (per-layer sliding windows) is not supported; "
            "use use_sliding_window=False"
        )


def transformer_config(
    hf_config: PretrainedConfig,
    mesh: Mesh,
    *,
    params_dtype: torch.dtype = torch.float32,
    bf16: bool = False,
    fp16: bool = False,
    **overrides: Any,
) -> TransformerConfig:
    """The ``TransformerConfig`` of `hf_config`'s architecture on `mesh`.

    What differs between families comes from the family's row (`twinkle_fn.models.families`):
    biases, q/k RMSNorms, the sliding window, the rotary layout, MoE router and experts and
    which layers have them. Common to all: GQA, RMSNorm, SwiGLU, dropout from the
    HF config (0 by default), parallel sizes and sequence parallelism from `mesh`, CPU
    initialisation, per-token loss and variable sequence lengths. With CUDA, fused kernels:
    megatron's compiled SwiGLU (``bias_activation_fusion``) and bias-dropout-add
    (``bias_dropout_fusion``) and the SDPA spec's compiled RMSNorm (``persist_layer_norm``,
    see `twinkle_fn.backends.megatron.spec.RMSNorm`; megatron's own local spec refuses it without
    apex); set them False for the unfused ops. A family with multi-latent attention
    (`Family.latent_attention`) gets an ``MLATransformerConfig`` (`mla.mla_fields`). Any
    ``TransformerConfig`` field in `overrides` wins over the derived value.

    Raises ``ValueError`` for an unknown family or one megatron-core cannot express
    (`bridge_rules.megatron_family`), an unknown override name, an unsupported
    architecture option, or a mesh size that does not divide the model (attention heads, kv
    heads and MLP channels by tp, layers by pp, experts by ep; ep > 1 on a dense model; the
    latent down projections' rows by tp).
    """
    fam = megatron_family(hf_config)
    config_class = MLATransformerConfig if fam.latent_attention else TransformerConfig
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(config_class)})
    if unknown:
        raise ValueError(
            f"unknown TransformerConfig field(s) {', '.join(map(repr, unknown))} in overrides; "
            "pass fields of megatron.core.transformer.TransformerConfig"
        )
    _check_supported(hf_config)
    bias = _linear_bias(hf_config, fam)
    heads, groups = hf_config.num_attention_heads, hf_config.num_key_value_heads
    _require_divides(mesh.tp, "tp", heads, "attention heads")
    if fam.latent_attention:
        groups = heads  # every head has its own keys and values (`mla.mla_fields`)
    if groups >= mesh.tp:
        _require_divides(mesh.tp, "tp", groups, "key/value heads (query groups)")
    elif mesh.tp % groups:
        # Fewer kv heads than tp ranks: megatron replicates each over tp // groups ranks.
        raise ValueError(
            f"tp={mesh.tp} is not a multiple of the {groups} key/value heads of this model; "
            f"use a tp that divides {groups} or is a multiple of it"
        )
    moe_layers = fam.moe_layers(hf_config)
    if len(moe_layers) < hf_config.num_hidden_layers:
        _require_divides(mesh.tp, "tp", hf_config.intermediate_size, "MLP channels")
    _require_divides(mesh.pp, "pp", hf_config.num_hidden_layers, "layers")
    if not moe_layers and (mesh.ep > 1 or mesh.etp > 1):
        raise ValueError(
            f"mesh ep={mesh.ep}, etp={mesh.etp} needs a mixture-of-experts model but this "
            f"{fam.name} model is dense; use ep=1 and etp=1"
        )
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    sliding = fam.window(hf_config)
    compute_dtype = torch.bfloat16 if bf16 else torch.float16 if fp16 else params_dtype
    on_cuda = torch.cuda.is_available()
    fields: dict[str, Any] = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=bias,
        add_qkv_bias=fam.has_bias("qkv", hf_config),
        qk_layernorm=fam.has_qk_norm(hf_config),
        layernorm_zero_centered_gamma=fam.norm_offset,
        attention_output_gate=fam.attention_gate,
        rotary_interleaved=fam.rope == "interleaved",
        # HF's window of W tokens includes the query itself: W - 1 to the left, none right.
        window_size=(sliding - 1, 0) if sliding else None,
        hidden_dropout=0.0,
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
        init_method_std=getattr(hf_config, "initializer_range", 0.02),
        tensor_model_parallel_size=mesh.tp,
        pipeline_model_parallel_size=mesh.pp,
        context_parallel_size=mesh.cp,
        expert_model_parallel_size=mesh.ep,
        expert_tensor_parallel_size=mesh.etp,
        sequence_parallel=mesh.sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=compute_dtype,
        bf16=bf16,
        fp16=fp16,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        # torch.compile'd kernels (megatron's jit_fuser for SwiGLU and bias-dropout-add, the
        # SDPA spec's RMSNorm for persist_layer_norm): CUDA only, where each replaces several
        # memory-bound passes; compiling for the CPU costs more than it saves.
        bias_activation_fusion=on_cuda,
        bias_dropout_fusion=on_cuda,
        persist_layer_norm=on_cuda,
        calculate_per_token_loss=True,
        variable_seq_lengths=True,
        # The only dispatcher that allows variable sequence lengths (megatron checks it even
        # for dense models).
        moe_token_dispatcher_type="alltoall",
    )
    if moe_layers:
        fields.update(_moe_fields(hf_config, fam, mesh))
    if fam.linear_attention is not None:
        fields.update(gated_delta_net.config_fields(hf_config, fam, mesh))
    if fam.latent_attention:
        fields.update(mla_fields(hf_config, mesh))
    fields.update(overrides)
    return config_class(**fields)
