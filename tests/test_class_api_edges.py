"""The class API's edges on one process: settings that would silently mean something else are
refused before any compute (naming the field, the value and the fix), and a step with nothing
to step is an error, not a silent no-op."""

import pytest

from twinkle.model import TransformersModel
from twinkle_fn.testing import random_features, tiny_config

LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}


pytestmark = pytest.mark.usefixtures("one_thread")


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


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda m: m.set_optimizer("AdamW", lr=0.0), r"^lr must be > 0, got 0.0: .*positive"),
        (lambda m: m.set_optimizer("SGD", lr=0), r"^lr must be > 0, got 0.0"),
        (
            lambda m: m.set_lr_scheduler(
                "CosineWarmupScheduler", num_warmup_steps=200, num_training_steps=100
            ),
            r"^CosineWarmupScheduler\(num_warmup_steps=200, num_training_steps=100\): "
            r"num_warmup_steps \(200\) must be < num_training_steps "
            r"\(100\): .*lower num_warmup_steps or raise num_training_steps",
        ),
        (
            lambda m: m.set_lr_scheduler(
                "LinearWarmupScheduler", num_warmup_steps=10, num_training_steps=10
            ),
            r"num_warmup_steps \(10\) must be < num_training_steps \(10\)",
        ),
        (
            lambda m: m.set_lr_scheduler("default", lr_warmup_steps=20, lr_decay_steps=10),
            r"lr_warmup_steps \(20\) must be < lr_decay_steps \(10\): .*lower lr_warmup_steps",
        ),
        (lambda m: m.save(output_dir="unused", interval=0), r"^save\(interval=0\): .*interval=1"),
        (
            lambda m: m.set_lr_scheduler("CosineAnnealingLR", T_max=0),
            r"^CosineAnnealingLR\(T_max=0\): ",
        ),
        (
            lambda m: m.set_lr_scheduler(
                "CosineWarmupScheduler", num_warmup_steps=-1, num_training_steps=5
            ),
            r"^CosineWarmupScheduler\(num_warmup_steps=-1, num_training_steps=5\): .*>= 0, got -1",
        ),
        (
            lambda m: m.clip_grad_and_step(max_grad_norm=0),
            r"^max_grad_norm must be a positive number, got 0; pass e.g. max_grad_norm=1.0",
        ),
    ],
)
def test_a_zero_lr_a_warmup_past_the_run_and_interval_zero_are_refused(call, match, tmp_path):
    """One policy with the CLI and the core: an lr <= 0 and a warmup not shorter than its
    schedule are refused (today lr 0 was accepted, the warmup error named the core's fields
    and save(interval=0) raised ZeroDivisionError), before anything is built or written."""
    model = _model()
    with pytest.raises(ValueError, match=match):
        call(model)
    assert not model._groups.built and not (tmp_path / "unused").exists()


def test_megatron_optimizer_refuses_a_zero_lr():
    from twinkle.model.megatron import optimizer_spec

    with pytest.raises(ValueError, match=r"^lr must be > 0, got 0.0"):
        optimizer_spec("default", lr=0.0)
