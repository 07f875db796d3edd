import pytest
import torch

from twinkle_fn.optim.masks import decay_targets, default_decay_mask, resolve_mask
from twinkle_fn.pytree import tree_flatten_with_path


def test_default_mask_decays_matrices_but_not_biases_or_norms():
    layer = torch.nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16)
    params = dict(layer.named_parameters())
    decayed = {name for name, p in params.items() if default_decay_mask(name, p)}
    assert decayed == {
        "self_attn.in_proj_weight",
        "self_attn.out_proj.weight",
        "linear1.weight",
        "linear2.weight",
    }


@pytest.mark.parametrize(
    ("path", "shape", "decay"),
    [
        ("model.embed_tokens.weight", (32, 8), True),
        ("model.layers.0.self_attn.q_proj.weight", (8, 8), True),
        ("model.layers.0.self_attn.q_proj.bias", (8,), False),
        ("model.layers.0.input_layernorm.weight", (8,), False),
        ("model.layers.0.self_attn.q_norm.weight", (4,), False),
        ("model.norm.weight", (8,), False),
        ("encoder.layer.0.output.LayerNorm.weight", (8,), False),
        ("model.layers.0.mlp.experts.w1", (2, 8, 16), True),
        ("model.layers.0.norm_proj.weight", (8, 8), False),
    ],
)
def test_default_mask_on_hf_names(path, shape, decay):
    assert default_decay_mask(path, torch.empty(shape)) is decay


def _params():
    return {"b": torch.zeros(3), "a": {"weight": torch.zeros(2, 2), "norm": torch.zeros(2, 2)}}


def test_resolve_mask_forms_follow_leaf_order():
    params = _params()
    assert [p for p, _ in tree_flatten_with_path(params)] == ["a.norm", "a.weight", "b"]
    assert resolve_mask(None, params) == [True, True, True]
    assert resolve_mask(default_decay_mask, params) == [False, True, False]
    tree_mask = {"b": True, "a": {"weight": False, "norm": True}}
    assert resolve_mask(tree_mask, params) == [True, False, True]


def test_resolve_mask_rejects_bad_masks():
    params = _params()
    with pytest.raises(ValueError, match="shaped like the params"):
        resolve_mask({"b": True}, params)
    with pytest.raises(TypeError, match=r"mask for 'a\.norm' is a int"):
        resolve_mask(lambda path, t: 1, params)
    with pytest.raises(TypeError, match="mask for 'b' is a Tensor"):
        resolve_mask({"b": torch.tensor(True), "a": {"weight": True, "norm": True}}, params)


def test_decay_targets_needs_params():
    with pytest.raises(ValueError, match="adamw: weight_decay > 0 needs the params"):
        decay_targets(None, None, _params(), "adamw")
    flags, leaves = decay_targets(default_decay_mask, _params(), _params(), "adamw")
    assert flags == [False, True, False] and [t.shape for t in leaves] == [(2, 2), (2, 2), (3,)]
