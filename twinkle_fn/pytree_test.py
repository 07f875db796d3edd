import math

import pytest
import torch

from twinkle_fn import pytree as pt


def _tree():
    return {"b": [torch.tensor([1.0, 2.0]), None], "a": {"w": torch.ones(2, 2)}}


def test_flatten_with_path_uses_dotted_sorted_keys():
    paths = [p for p, _ in pt.tree_flatten_with_path(_tree())]
    assert paths == ["a.w", "b.0"]


def test_add_scale_zeros_clone():
    t = _tree()
    s = pt.tree_add(t, pt.tree_scale(t, 2.0))
    assert torch.equal(s["b"][0], torch.tensor([3.0, 6.0]))
    assert s["b"][1] is None
    z = pt.tree_zeros_like(t)
    assert all(torch.count_nonzero(x) == 0 for x in pt.tree_leaves(z))
    c = pt.tree_clone(t)
    c["a"]["w"].add_(1)
    assert torch.equal(t["a"]["w"], torch.ones(2, 2))


def test_clone_keeps_parameters():
    p = torch.nn.Parameter(torch.ones(3))
    c = pt.tree_clone({"p": p})["p"]
    assert isinstance(c, torch.nn.Parameter) and c.requires_grad and c is not p


@pytest.mark.parametrize("norm_type", [1.0, 2.0, float("inf")])
def test_global_norm_matches_flat_vector(norm_type):
    t = {"x": torch.randn(5, 3, dtype=torch.float64), "y": torch.randn(7, dtype=torch.float64)}
    flat = torch.cat([t["x"].flatten(), t["y"]])
    expected = torch.linalg.vector_norm(flat, norm_type).item()
    assert math.isclose(pt.tree_global_norm(t, norm_type).item(), expected, rel_tol=1e-6)


def test_global_norm_of_empty_tree_raises():
    with pytest.raises(ValueError, match="no tensor leaves"):
        pt.tree_global_norm({"a": None})
