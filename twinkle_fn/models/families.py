"""The model families the core knows, keyed by the HF config's ``model_type``.

A family is more than "transformers can build it": later backends attach a sharding plan and a
Megatron bridge to each entry, so an unknown family is refused up front with the list of known ones
rather than failing deep inside a parallel wrapper.
"""

from __future__ import annotations

from transformers import PretrainedConfig

FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")


def family_of(config: PretrainedConfig) -> str:
    """The family name of `config` (its ``model_type``).

    Raises ``ValueError`` naming the model type and the supported families when it is unknown.
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(
            f"unknown model family {model_type!r} (config.model_type); twinkle supports "
            f"{', '.join(FAMILIES)}. Use a config of one of these families."
        )
    return model_type
