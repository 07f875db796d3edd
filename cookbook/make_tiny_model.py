"""Write a tiny random-init Qwen3 (Qwen3-MoE, Qwen3.5-MoE) model with a character tokenizer into a directory.

The cookbook scripts run upstream Twinkle's examples on CPU with no download: this is the
"model id" they load (a local HF directory: config.json, safetensors weights, tokenizer)::

    python cookbook/make_tiny_model.py /tmp/tiny-qwen3
    python cookbook/make_tiny_model.py /tmp/tiny-qwen3-moe --family qwen3_moe
    python cookbook/make_tiny_model.py /tmp/tiny-qwen3_5-moe --family qwen3_5_moe_text
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from twinkle_fn.data import char_tokenizer

# family -> its config fields beyond the dense ones (4 experts, 2 per token, every layer MoE;
# Qwen3.5-MoE's text model: a Gated DeltaNet layer, then a full attention layer, each with a
# shared expert beside the routed ones)
FAMILIES = {
    "qwen3": {},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1},
    "qwen3_5_moe_text": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "full_attention_interval": 2,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
    },
}


def make_tiny_model(
    path: str | Path,
    hidden_size: int = 64,
    num_layers: int = 2,
    seed: int = 0,
    family: str = "qwen3",
) -> Path:
    """Save a `num_layers`-layer model of `family` (one of `FAMILIES`) of
    width `hidden_size` (random weights from `seed`) and the character-level ChatML tokenizer
    to `path`; returns the path. Raises ``ValueError`` for another family.

    Qwen3 rather than Qwen2: transformers' ``AutoTokenizer`` replaces the saved tokenizer of a
    ``qwen2`` directory by its byte-level ``Qwen2Tokenizer``, which drops the whitespace the
    character vocabulary encodes; for ``qwen3`` it loads the tokenizer that was saved.
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    tokenizer = char_tokenizer()
    moe = {}
    if "num_experts" in FAMILIES[family]:
        moe = {"moe_intermediate_size": hidden_size // 2}
    if family == "qwen3_5_moe_text":
        moe |= {
            "shared_expert_intermediate_size": hidden_size,
            "linear_key_head_dim": hidden_size // 4,
            "linear_value_head_dim": hidden_size // 4,
        }
    config = AutoConfig.for_model(
        family,
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        head_dim=hidden_size // 4,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **FAMILIES[family],
        **moe,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="directory to write")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--family", choices=list(FAMILIES), default="qwen3")
    args = parser.parse_args()
    make_tiny_model(args.path, args.hidden_size, args.num_layers, family=args.family)


if __name__ == "__main__":
    main()
