"""Tiny HF configs of every model family the core knows: 2 layers, hidden size 32, a 96-token
vocabulary, so a model builds and trains in seconds on a CPU without a download.

A family's row in `twinkle_fn.models.families` needs its entry in `_EXTRA` here (the recipe in
that module's docstring): the conformance suite and every test parametrised over the families
build their models from `tiny_config`.
"""

from __future__ import annotations

from typing import Any

from transformers import AutoConfig, PretrainedConfig

_BASE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
# one dense layer then one MoE layer; 2 groups of 2 experts, one group per token (a group's
# score is its top-2 sum, which megatron matches when top_k // topk_group == 2)
_GROUPED_MOE = dict(
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=1.5,
)
_EXTRA: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {},
    "qwen3": {"head_dim": 8},
    "qwen3_moe": {
        "head_dim": 8,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "decoder_sparse_step": 1,
    },
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 32,
        "decoder_sparse_step": 1,
    },
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 16},
    # the grouped router's MoE; half of each head rotated
    "glm4_moe": {"head_dim": 8, **_GROUPED_MOE},
    # multi-latent attention with a query down projection (q_lora_rank; None gives q_proj);
    # as many kv heads as heads (HF's MLA expands keys to every head); the grouped router's MoE
    "deepseek_v3": {
        "num_key_value_heads": 4,
        "q_lora_rank": 16,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
        **_GROUPED_MOE,
    },
    # a Gated DeltaNet layer, then a full attention layer (every second layer attends fully)
    "qwen3_5_text": {
        "head_dim": 8,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "full_attention_interval": 2,
    },
    # qwen3_5_text's two layers, each with 4 routed experts (2 per token) and a shared expert
    "qwen3_5_moe_text": {
        "head_dim": 8,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "full_attention_interval": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 32,
    },
    # sliding and global layers alternate; a window shorter than the test sequences
    "gemma3_text": {
        "head_dim": 8,
        "query_pre_attn_scalar": 8,
        "sliding_window": 4,
        "sliding_window_pattern": 2,
    },
}


def tiny_config(family: str = "qwen2", **overrides: Any) -> PretrainedConfig:
    """A 2-layer config of `family` with hidden size 32 and a 96-token vocabulary."""
    if family not in _EXTRA:
        raise ValueError(f"no tiny config for family {family!r}; known: {', '.join(_EXTRA)}")
    return AutoConfig.for_model(family, **{**_BASE, **_EXTRA[family], **overrides})
