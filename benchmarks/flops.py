"""Model FLOPs utilisation of a dense decoder's training step: the FLOPs a token costs, the
device's bf16 peak and their ratio to a measured tokens/s."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

# Dense bf16 tensor-core peak of one H100/H200 SXM (the MFU denominator).
HOPPER_BF16_PEAK = 989e12
MFU_FORMULA = (
    "MFU = tokens/s x (6 x matmul params incl. lm_head + 6 x layers x hidden x seq) / peak"
)


def matmul_params(config: PretrainedConfig) -> int:
    """Weights that take part in a matmul per token: every decoder linear plus the lm_head.

    The embedding lookup is not a matmul; the lm_head counts even when tied to it. Biases and
    norm weights are left out (they add no matmul FLOPs).
    """
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = config.num_key_value_heads * head_dim
    per_layer = hidden * q + 2 * hidden * kv + q * hidden + 3 * hidden * inter
    return config.num_hidden_layers * per_layer + config.vocab_size * hidden


def flops_per_token(config: PretrainedConfig, seq: int) -> int:
    """Training FLOPs per token of `MFU_FORMULA`: ``6 N + 6 L H S``."""
    return 6 * matmul_params(config) + 6 * config.num_hidden_layers * config.hidden_size * seq


def mfu(tokens_per_s: float, flops_per_tok: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation (a fraction), or None without a known peak."""
    return None if peak_flops is None else tokens_per_s * flops_per_tok / peak_flops


def default_peak(device: torch.device) -> float | None:
    """The dense bf16 peak FLOP/s of `device` when known (H100/H200), else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return HOPPER_BF16_PEAK if ("H100" in name or "H200" in name) else None
