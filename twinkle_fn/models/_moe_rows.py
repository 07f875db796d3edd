"""The rows of the mixture-of-experts families (softmax attention, or multi-latent attention)."""

from __future__ import annotations

from twinkle_fn.models._family_row import (
    ATTENTION_PLAN,
    COLWISE,
    MLP_PLAN,
    ROWWISE,
    Family,
    Moe,
    SharedExpert,
    mlp_plan,
)
from twinkle_fn.models._layer_rules import (
    after_first_k_dense,
    every_layer,
    n_shared_experts_ffn,
    sparse_step_moe_layers,
)

QWEN3_MOE = Family(
    name="qwen3_moe",
    # Dense layers (mlp_only_layers) keep their MLP whole too: one plan serves every layer.
    tp_plan=dict(ATTENTION_PLAN),
    qkv_bias="attention_bias",
    o_bias="attention_bias",
    mlp_bias=False,
    qk_norm=True,
    moe=Moe(
        layers=sparse_step_moe_layers,
        router="mlp.gate",
        experts="mlp.experts",
        expert_linears=("gate_proj", "up_proj", "down_proj"),
        num_experts="num_experts",
        top_k="num_experts_per_tok",
        ffn="moe_intermediate_size",
        renormalize="norm_topk_prob",
        shared=None,
    ),
    mask_mapping=False,
    # transformers leaves it None unless use_sliding_window (then every layer has it).
    sliding_window="sliding_window",
    rope="rotate_half",
    sequence_parallel=False,
    megatron=None,
)

QWEN2_MOE = Family(
    name="qwen2_moe",
    # The shared expert is a dense MLP on every token: split like one. Its sigmoid gate
    # ([1, hidden]) and the routed experts stay whole.
    tp_plan={
        **ATTENTION_PLAN,
        **mlp_plan("mlp.shared_expert"),
    },
    qkv_bias="qkv_bias",
    o_bias=False,
    mlp_bias=False,
    qk_norm=False,
    moe=Moe(
        layers=sparse_step_moe_layers,
        router="mlp.gate",
        experts="mlp.experts",
        expert_linears=("gate_proj", "up_proj", "down_proj"),
        num_experts="num_experts",
        top_k="num_experts_per_tok",
        ffn="moe_intermediate_size",
        renormalize="norm_topk_prob",
        shared=SharedExpert(
            mlp="mlp.shared_expert",
            linears=("gate_proj", "up_proj", "down_proj"),
            ffn="shared_expert_intermediate_size",
            gate="mlp.shared_expert_gate",
        ),
    ),
    mask_mapping=True,
    # as qwen2: windows per layer only with use_sliding_window (refused by megatron)
    sliding_window=None,
    rope="rotate_half",
    # the routed experts' output is not a rowwise linear's
    sequence_parallel=False,
    megatron=None,
)

MIXTRAL = Family(
    name="mixtral",
    tp_plan=dict(ATTENTION_PLAN),
    qkv_bias=False,
    o_bias=False,
    mlp_bias=False,
    qk_norm=False,
    moe=Moe(
        layers=every_layer,
        router="block_sparse_moe.gate",
        experts="block_sparse_moe.experts",
        expert_linears=("w1", "w3", "w2"),
        num_experts="num_local_experts",
        top_k="num_experts_per_tok",
        ffn="intermediate_size",
        renormalize=True,
        shared=None,
    ),
    mask_mapping=False,
    sliding_window="sliding_window",
    rope="rotate_half",
    sequence_parallel=False,
    megatron=None,
)

# DeepSeek-V3's MoE block, GLM-4 MoE's too: after the first dense layers, sigmoid scores with
# an expert bias that only chooses experts, grouped routing, scaled weights, and ungated shared
# experts of n_shared_experts experts' size.
_DEEPSEEK_MOE = Moe(
    layers=after_first_k_dense,
    router="mlp.gate",
    experts="mlp.experts",
    expert_linears=("gate_proj", "up_proj", "down_proj"),
    num_experts="n_routed_experts",
    top_k="num_experts_per_tok",
    ffn="moe_intermediate_size",
    renormalize="norm_topk_prob",
    shared=SharedExpert(
        mlp="mlp.shared_experts",
        linears=("gate_proj", "up_proj", "down_proj"),
        ffn=n_shared_experts_ffn,
        gate=None,
    ),
    score="sigmoid",
    expert_bias="e_score_correction_bias",
    groups="n_group",
    group_topk="topk_group",
    scale="routed_scaling_factor",
)

GLM4_MOE = Family(
    name="glm4_moe",
    # the first_k_dense_replace dense layers split their MLP, the MoE layers their shared
    # experts; routed experts and the router stay whole
    tp_plan={
        **ATTENTION_PLAN,
        **MLP_PLAN,
        **mlp_plan("mlp.shared_experts"),
    },
    qkv_bias="attention_bias",
    o_bias=False,
    mlp_bias=False,
    qk_norm="use_qk_norm",
    moe=_DEEPSEEK_MOE,
    mask_mapping=False,
    sliding_window=None,
    # partial rotary (rope_parameters' partial_rotary_factor): the first channels of each
    # head are rotated in HF's rotate_half layout, the rest pass through
    rope="rotate_half",
    sequence_parallel=False,
    megatron=None,
)

DEEPSEEK_V3 = Family(
    name="deepseek_v3",
    # multi-latent attention: the up projections (q_b_proj, or q_proj without q_lora_rank,
    # and kv_b_proj) give each head its rows, so they split by heads like q/k/v; the down
    # projections feed every head and stay whole (tp_whole).
    tp_plan={
        "self_attn.q_b_proj": COLWISE,
        "self_attn.q_proj": COLWISE,
        "self_attn.kv_b_proj": COLWISE,
        "self_attn.o_proj": ROWWISE,
        **MLP_PLAN,
        **mlp_plan("mlp.shared_experts"),
    },
    tp_whole=("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"),
    qkv_bias=False,
    o_bias="attention_bias",
    mlp_bias=False,
    qk_norm=False,
    moe=_DEEPSEEK_MOE,
    mask_mapping=False,
    sliding_window=None,
    # rope_interleave (default True): neighbouring channels of the rotary part are pairs
    rope="interleaved",
    sequence_parallel=False,
    latent_attention=True,
    megatron=None,
)
