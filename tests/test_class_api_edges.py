"""The class API's edges on one process: settings that would silently mean something else are
refused before any compute (naming the field, the value and the fix), and a step with nothing
to step is an error, not a silent no-op."""

import pytest
import torch

from twinkle.model import TransformersModel
from twinkle_fn.testing import random_features, tiny_config

LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matrices: torch's intra-op threads only contend on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model():
    return TransformersModel(config=tiny_config(), mixed_precision="no", seed=0)


GAS_ZERO = r"gradient_accumulation_steps must be a positive int .*got 0; pass 1"


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.add_adapter_to_model("a", LORA, gradient_accumulation_steps=0),
        lambda m: m.forward_backward(inputs=random_features(1), gradient_accumulation_steps=0),
        lambda m: m.clip_grad_and_step(gradient_accumulation_steps=0),
        lambda m: m.clip_grad_norm(gradient_accumulation_steps=0),
        lambda m: m.step(gradient_accumulation_steps=0),
        lambda m: m.zero_grad(gradient_accumulation_steps=0),
        lambda m: m.lr_step(gradient_accumulation_steps=0),
    ],
)
def test_zero_accumulation_steps_is_refused_before_any_compute(call):
    """Today 0 was read as "unset" and became the group's 1. A forward_backward refused
    builds no state and accumulates nothing."""
    model = _model()
    if "forward_backward" not in call.__code__.co_names:
        model.forward_backward(inputs=random_features(1))
    pending = model._groups.resolve(None).pending.micro_batches
    with pytest.raises(ValueError, match=GAS_ZERO):
        call(model)
    assert model._groups.resolve(None).pending.micro_batches == pending
    assert model._groups.built == (pending > 0)


@pytest.mark.parametrize("call", ["step", "clip_grad_and_step"])
def test_a_step_with_nothing_accumulated_is_refused(call):
    model = _model()
    with pytest.raises(ValueError, match=rf"^{call}\(\) found no accumulated micro-batch.*"):
        getattr(model, call)()
    assert not model._groups.built  # refused before building anything
    model.forward_backward(inputs=random_features(1))
    model.zero_grad()  # on a boundary: drops the micro-batch
    with pytest.raises(ValueError, match="forward_backward"):
        getattr(model, call)()
    assert int(model.state.step) == 0


def test_a_step_after_the_update_is_a_no_op_as_in_upstreams_loop():
    """upstream's four calls: clip_grad_norm, step, zero_grad, lr_step; a second step (and
    MegatronModel's step after its clip_grad_norm made the update) finds the micro-batches
    consumed: nothing to do, no error."""
    model = _model()
    model.forward_backward(inputs=random_features(2))
    assert model.clip_grad_and_step() is not None
    model.step()
    model.zero_grad()
    model.lr_step()
    assert int(model.state.step) == 1
    assert model.clip_grad_and_step() is None
    assert int(model.state.step) == 1
