"""The config readers family rows name: which decoder layers are MoE or linear attention, and
the size of a shared expert, each a function of the HF config."""

from __future__ import annotations

from collections.abc import Callable

from transformers import PretrainedConfig


def typed_layers(kind: str) -> Callable[[PretrainedConfig], tuple[int, ...]]:
    """The rule "the layers whose ``config.layer_types`` entry is `kind`"."""

    def layers(config: PretrainedConfig) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(config.layer_types) if t == kind)

    return layers


def sparse_step_moe_layers(config: PretrainedConfig) -> tuple[int, ...]:
    """Qwen3-MoE's MoE layers (transformers' rule): layer ``i`` unless it is in
    ``mlp_only_layers``, when ``num_experts > 0`` and ``(i + 1) % decoder_sparse_step == 0``."""
    if not getattr(config, "num_experts", 0):
        return ()
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", 1) or 1
    layers = range(config.num_hidden_layers)
    return tuple(i for i in layers if i not in dense and (i + 1) % step == 0)


def after_first_k_dense(config: PretrainedConfig) -> tuple[int, ...]:
    """GLM-4 MoE's and DeepSeek-V3's MoE layers: every layer from ``first_k_dense_replace`` on
    (the first k are dense MLPs)."""
    return tuple(range(config.first_k_dense_replace, config.num_hidden_layers))


def n_shared_experts_ffn(config: PretrainedConfig) -> int:
    """The shared MLP of GLM-4 MoE / DeepSeek-V3: ``n_shared_experts`` experts' channels."""
    return config.moe_intermediate_size * config.n_shared_experts


def every_layer(config: PretrainedConfig) -> tuple[int, ...]:
    """Every decoder layer (Mixtral: all of them are MoE)."""
    return tuple(range(config.num_hidden_layers))
