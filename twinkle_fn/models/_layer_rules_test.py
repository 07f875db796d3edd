"""twinkle_fn/models/_layer_rules.py: each row's MoE-layer rule names the layers transformers
gives experts, under configs whose MoE layers differ."""

import pytest
from transformers.core_model_loading import revert_weight_conversion

from twinkle_fn.models.families import FAMILIES, family
from twinkle_fn.models.families_test import _module
from twinkle_fn.testing import tiny_config

# Configs whose MoE layers differ: sparse steps and dense layers (fields other families ignore).
_MOE_CASES = [
    {},
    {"num_hidden_layers": 4, "decoder_sparse_step": 2},
    {"num_hidden_layers": 4, "mlp_only_layers": [0, 3]},
    {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [1]},
    {"num_experts": 0},
]


@pytest.mark.parametrize("case", _MOE_CASES, ids=lambda c: str(c) or "default")
@pytest.mark.parametrize("name", FAMILIES)
def test_the_moe_layer_rule_is_what_transformers_builds(name, case):
    """Read in the checkpoint names (transformers renames and fuses experts in memory)."""
    row = family(name)
    config = tiny_config(name, **case)
    if row.moe is not None and not getattr(config, row.moe.num_experts) and row.moe.layers(config):
        pytest.skip(f"{name} has no dense form: every layer is MoE whatever the expert count")
    on_disk = revert_weight_conversion(_module(config), _module(config).state_dict())
    experts = row.moe.experts if row.moe else "mlp.experts"
    built = tuple(
        i
        for i in range(config.num_hidden_layers)
        if any(n.startswith(f"model.layers.{i}.{experts}.") for n in on_disk)
    )
    assert row.moe_layers(config) == built
    if row.moe is None or not built:
        return
    # the names the bridge reads: the router, one tensor per expert linear on disk, the sizes
    layer = f"model.layers.{built[-1]}."
    n_experts = getattr(config, row.moe.num_experts)
    assert on_disk[f"{layer}{row.moe.router}.weight"].shape == (n_experts, config.hidden_size)
    assert 0 < getattr(config, row.moe.top_k) <= n_experts
    ffn = getattr(config, row.moe.ffn)
    gate, up, down = (
        on_disk[f"{layer}{row.moe.experts}.{n_experts - 1}.{linear}.weight"]
        for linear in row.moe.expert_linears
    )
    assert gate.shape == up.shape == (ffn, config.hidden_size)
    assert down.shape == (config.hidden_size, ffn)
    shared = row.moe.shared
    mlp_like = {n for n in on_disk if ".mlp." in n and ".experts." not in n and "gate." not in n}
    if shared is None:  # no MLP tensor beside the router and experts
        assert not {n for n in mlp_like if n.startswith(layer)}
        return
    ffn = shared.size(config)
    gate, up, down = (on_disk[f"{layer}{shared.mlp}.{n}.weight"] for n in shared.linears)
    assert gate.shape == up.shape == (ffn, config.hidden_size)
    assert down.shape == (config.hidden_size, ffn)
    if shared.gate is not None:
        assert on_disk[f"{layer}{shared.gate}.weight"].shape == (1, config.hidden_size)
