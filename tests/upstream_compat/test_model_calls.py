"""Training knobs upstream scripts pass to `set_optimizer`: ``Adam`` (what torch computes, when
it equals the core's AdamW) and torch's kernel switches (``foreach``/``fused``/``capturable``),
which pick how torch computes an update and so cannot change it."""

import pytest
import torch

from twinkle.model import TransformersModel
from twinkle_fn.testing import random_features, tiny_config


def _one_step(optimizer_cls, **kwargs):
    model = TransformersModel(config=tiny_config(), mixed_precision="no", seed=0)
    model.set_optimizer(optimizer_cls, **kwargs)
    model.forward_backward(inputs=random_features(4, seed=2))
    model.clip_grad_and_step()
    return model.get_state_dict()


def test_adam_without_decay_is_adamw_without_decay_and_kernel_switches_change_nothing():
    adam = _one_step(torch.optim.Adam, lr=1e-2, betas=(0.8, 0.95), foreach=True, fused=False)
    adamw = _one_step("AdamW", lr=1e-2, betas=(0.8, 0.95), weight_decay=0.0)
    initial = TransformersModel(config=tiny_config(), mixed_precision="no", seed=0)
    assert adam.keys() == adamw.keys()
    assert all(torch.equal(adam[k], adamw[k]) for k in adam)
    assert any(not torch.equal(adam[k], v) for k, v in initial.get_state_dict().items())


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        ("Adam", {"weight_decay": 0.1}, r"Adam\(weight_decay=0\.1\) is coupled L2.*'AdamW'"),
        ("Adam", {"amsgrad": True}, r"Adam\(amsgrad=True\) is not supported"),
        ("Adagrad", {}, r"unknown optimizer 'Adagrad'; known: AdamW, default, Adam, SGD"),
    ],
)
def test_optimizers_the_core_cannot_express_are_refused(cls, kwargs, match):
    model = TransformersModel(config=tiny_config(), mixed_precision="no", seed=0)
    with pytest.raises(ValueError, match=match):
        model.set_optimizer(cls, lr=1e-3, **kwargs)


def test_a_torch_argument_that_changes_the_update_is_still_refused():
    model = TransformersModel(config=tiny_config(), mixed_precision="no", seed=0)
    with pytest.raises(TypeError, match="maximize"):
        model.set_optimizer("AdamW", lr=1e-3, maximize=True)
