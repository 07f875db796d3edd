"""The rows of the hybrid families: Gated DeltaNet (linear attention) layers between attention
layers."""

from __future__ import annotations

from twinkle_fn.models._family_row import (
    ATTENTION_PLAN,
    MLP_PLAN,
    Family,
    LinearAttention,
    Moe,
    SharedExpert,
    mlp_plan,
)
from twinkle_fn.models._layer_rules import every_layer, typed_layers

# Qwen3.5's Gated DeltaNet layers, where layer_types says "linear_attention", and their linears,
# which stay whole under tp (see qwen3_5_text).
_DELTANET = LinearAttention(layers=typed_layers("linear_attention"), module="linear_attn")
_DELTANET_WHOLE = (
    "linear_attn.in_proj_qkv",
    "linear_attn.in_proj_z",
    "linear_attn.in_proj_b",
    "linear_attn.in_proj_a",
    "linear_attn.out_proj",
)

QWEN3_5_TEXT = Family(
    name="qwen3_5_text",
    # Gated DeltaNet layers (linear_attn) between full attention layers (layer_types). The
    # full attention's q_proj gives each head its query and its output gate side by side,
    # so it splits by heads; a DeltaNet's fused q/k/v rows and depthwise convolution do
    # not split per head that way: its linears stay whole (tp_whole).
    tp_plan={**ATTENTION_PLAN, **MLP_PLAN},
    tp_whole=_DELTANET_WHOLE,
    qkv_bias="attention_bias",
    o_bias="attention_bias",
    mlp_bias=False,
    qk_norm=True,
    moe=None,
    mask_mapping=True,
    sliding_window=None,
    rope="rotate_half",
    # a DeltaNet layer is outside the sequence-parallel plan (it needs the whole sequence)
    sequence_parallel=False,
    megatron=None,
    linear_attention=_DELTANET,
    norm_offset=True,
    attention_gate=True,
)

QWEN3_5_MOE_TEXT = Family(
    name="qwen3_5_moe_text",
    # qwen3_5_text's layers (Gated DeltaNet between full attention layers) with an MoE block
    # in every layer: routed experts (whole under tp, split over ep) beside a shared expert
    # that splits like a dense MLP; its sigmoid gate ([1, hidden]) stays whole.
    tp_plan={
        **ATTENTION_PLAN,
        **mlp_plan("mlp.shared_expert"),
    },
    tp_whole=_DELTANET_WHOLE,
    qkv_bias="attention_bias",
    o_bias="attention_bias",
    mlp_bias=False,
    qk_norm=True,
    moe=Moe(
        layers=every_layer,
        router="mlp.gate",
        experts="mlp.experts",
        expert_linears=("gate_proj", "up_proj", "down_proj"),
        num_experts="num_experts",
        top_k="num_experts_per_tok",
        ffn="moe_intermediate_size",
        # its router always renormalises the top-k weights (no norm_topk_prob field)
        renormalize=True,
        shared=SharedExpert(
            mlp="mlp.shared_expert",
            linears=("gate_proj", "up_proj", "down_proj"),
            ffn="shared_expert_intermediate_size",
            gate="mlp.shared_expert_gate",
        ),
    ),
    mask_mapping=True,
    sliding_window=None,
    rope="rotate_half",
    # a DeltaNet layer needs the whole sequence; the routed experts' output is not a
    # rowwise linear's
    sequence_parallel=False,
    megatron=(
        "twinkle's megatron layer spec builds Gated DeltaNet layers (qwen3_5_text) with a "
        "dense MLP only: an MoE block with a gated shared expert after a DeltaNet is not "
        "built, nor bridged, yet"
    ),
    linear_attention=_DELTANET,
    norm_offset=True,
    attention_gate=True,
    packed_rows=(
        "the Gated DeltaNet layers' recurrence and causal convolution (transformers' torch "
        "code, and fla's kernels as transformers calls them) do not restart at the packed "
        "samples' boundaries, so samples would read each other"
    ),
)
