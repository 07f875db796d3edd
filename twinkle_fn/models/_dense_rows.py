"""The rows of the dense families (an MLP in every layer, softmax attention only)."""

from __future__ import annotations

from twinkle_fn.models._family_row import ATTENTION_PLAN, MLP_PLAN, Family

LLAMA = Family(
    name="llama",
    tp_plan={**ATTENTION_PLAN, **MLP_PLAN},
    qkv_bias="attention_bias",
    o_bias="attention_bias",
    mlp_bias="mlp_bias",
    qk_norm=False,
    moe=None,
    mask_mapping=False,
    sliding_window=None,
    rope="rotate_half",
    sequence_parallel=True,
    megatron=None,
)

MISTRAL = Family(
    name="mistral",
    tp_plan={**ATTENTION_PLAN, **MLP_PLAN},
    qkv_bias=False,
    o_bias=False,
    mlp_bias=False,
    qk_norm=False,
    moe=None,
    mask_mapping=False,
    sliding_window="sliding_window",
    rope="rotate_half",
    sequence_parallel=True,
    megatron=None,
)

QWEN2 = Family(
    name="qwen2",
    tp_plan={**ATTENTION_PLAN, **MLP_PLAN},
    qkv_bias=True,
    o_bias=False,
    mlp_bias=False,
    qk_norm=False,
    moe=None,
    mask_mapping=True,
    # Qwen2/Qwen3 windows are per layer (use_sliding_window, max_window_layers)
    sliding_window=None,
    rope="rotate_half",
    sequence_parallel=True,
    megatron=None,
)

QWEN3 = Family(
    name="qwen3",
    tp_plan={**ATTENTION_PLAN, **MLP_PLAN},
    qkv_bias="attention_bias",
    o_bias="attention_bias",
    mlp_bias=False,
    qk_norm=True,
    moe=None,
    mask_mapping=True,
    sliding_window=None,
    rope="rotate_half",
    sequence_parallel=True,
    megatron=None,
)

GEMMA3_TEXT = Family(
    name="gemma3_text",
    tp_plan={**ATTENTION_PLAN, **MLP_PLAN},
    qkv_bias="attention_bias",
    o_bias="attention_bias",
    mlp_bias=False,
    qk_norm=True,
    moe=None,
    mask_mapping=True,
    # only the sliding layers of layer_types are windowed (the backends read each layer's)
    sliding_window=None,
    rope="rotate_half",
    # the norms after attention and after the MLP are outside the sequence-parallel plan
    sequence_parallel=False,
    megatron=(
        "megatron-core's GPTModel layer spec has no norms on the attention and MLP outputs "
        "(Gemma 3's pre/post-feedforward norms), no per-layer rotary base "
        "(rope_local_base_freq on sliding layers), no scaled embedding and no (1 + weight) "
        "RMSNorm"
    ),
)
