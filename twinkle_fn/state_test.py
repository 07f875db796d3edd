import optree
import pytest
import torch

from twinkle_fn.pytree import NAMESPACE, tree_leaves
from twinkle_fn.state import DonatedError, Grads, TrainState


def _state():
    params = {"w": torch.nn.Parameter(torch.ones(2, 2))}
    return TrainState(
        params=params,
        opt_state=({"w": torch.zeros(2, 2)}, torch.zeros((), dtype=torch.int64)),
        step=torch.zeros((), dtype=torch.int64),
        rng=torch.tensor(7),
        model="skeleton",
        tx="tx",
        mesh=None,
    )


def test_state_is_an_optree_node_with_static_metadata():
    s = _state()
    leaves, spec = optree.tree_flatten(s, namespace=NAMESPACE)
    assert len(leaves) == 5
    rebuilt = optree.tree_unflatten(spec, leaves)
    assert isinstance(rebuilt, TrainState) and rebuilt.model == "skeleton" and rebuilt.tx == "tx"
    assert rebuilt.params["w"] is s.params["w"]


def test_state_is_frozen_and_replace_shares_unchanged_fields():
    s = _state()
    with pytest.raises(AttributeError):
        s.step = torch.ones(())
    r = s.replace(step=s.step + 1)
    assert int(r.step) == 1 and int(s.step) == 0
    assert r.params is s.params


def test_copy_is_deep_and_keeps_parameters():
    s = _state()
    c = s.copy()
    assert isinstance(c.params["w"], torch.nn.Parameter)
    c.params["w"].data.add_(1)
    assert torch.equal(s.params["w"], torch.ones(2, 2))
    assert all(a is not b for a, b in zip(tree_leaves(s), tree_leaves(c), strict=True))


def test_donated_state_raises_on_every_tensor_field():
    s = _state()
    s.donate("step")
    assert s.donated
    for field in ("params", "opt_state", "step", "rng"):
        with pytest.raises(DonatedError, match="donated to step"):
            getattr(s, field)
    with pytest.raises(DonatedError):
        s.replace()
    assert s.model == "skeleton"


def test_grads_node_and_donation():
    g = Grads({"w": torch.ones(2)}, torch.tensor(3.0), torch.tensor(4), num_micro_batches=2)
    leaves, spec = optree.tree_flatten(g, namespace=NAMESPACE)
    assert len(leaves) == 3 and optree.tree_unflatten(spec, leaves).num_micro_batches == 2
    g.donate("fwd_bwd")
    with pytest.raises(DonatedError, match="fwd_bwd"):
        _ = g.params
