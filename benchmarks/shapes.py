"""The model shapes the benchmarks train, as HF configs built by hand (no download): Qwen2.5
dense shapes and Qwen3 shapes, each with a ``tiny`` one for CPU runs."""

from __future__ import annotations

from types import MappingProxyType

from transformers import AutoConfig, PretrainedConfig

# the CPU runs' shape, the same in both families
_TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
_QWEN25 = dict(
    model_type="qwen2",
    max_position_embeddings=32768,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    use_sliding_window=False,
)
QWEN25_SHAPES = MappingProxyType(
    {
        "tiny": _TINY,
        "qwen2.5-0.5b": dict(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
        ),
        "qwen2.5-1.5b": dict(
            vocab_size=151936,
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
        ),
    }
)
_QWEN3 = dict(
    model_type="qwen3",
    max_position_embeddings=40960,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
QWEN3_SHAPES = MappingProxyType(
    {
        "tiny": {**_TINY, "head_dim": 16},  # Qwen3's default head_dim is 128
        "qwen3-4b": dict(
            vocab_size=151936,
            hidden_size=2560,
            intermediate_size=9728,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
        ),
    }
)


def qwen25_config(shape: str) -> PretrainedConfig:
    """The HF ``Qwen2Config`` of `shape` (a key of `QWEN25_SHAPES`). Raises ``ValueError`` if
    unknown."""
    return _config(shape, QWEN25_SHAPES, _QWEN25)


def qwen3_config(shape: str) -> PretrainedConfig:
    """The HF ``Qwen3Config`` of `shape` (a key of `QWEN3_SHAPES`). Raises ``ValueError`` if
    unknown."""
    return _config(shape, QWEN3_SHAPES, _QWEN3)


def shape_config(shape: str) -> PretrainedConfig:
    """`qwen3_config` of a key of `QWEN3_SHAPES`, else `qwen25_config` (``tiny`` is the Qwen3
    one). Raises ``ValueError`` for a shape of neither."""
    return qwen3_config(shape) if shape in QWEN3_SHAPES else qwen25_config(shape)


def _config(shape: str, shapes: MappingProxyType[str, dict], family: dict) -> PretrainedConfig:
    if shape not in shapes:
        raise ValueError(f"unknown shape {shape!r}; use one of {', '.join(shapes)}")
    return AutoConfig.for_model(**{**family, **shapes[shape]})
