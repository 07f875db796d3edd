"""`twinkle.model.TransformersModel` on one process: parity with the functional API, gradient
accumulation, log-probs and the lr schedule. Checkpoints are in
``test_class_api_model_checkpoints.py``, model directories and cookbooks in
``test_class_api_model_cookbook.py``, refused calls and options in
``test_class_api_model_errors.py``.

float64 throughout (``dtype=torch.float64, mixed_precision='no'``) so that a mismatch is a
bug, not rounding: the class API calls the very same core functions on the very same batches as
the functional reference, so their losses and parameters must be bit-identical.
"""

import math

import pytest
import torch
from peft import LoraConfig

import twinkle_fn as tf
from twinkle.model import TransformersModel
from twinkle_fn.data import pack, pad_collate
from twinkle_fn.testing import random_features, tiny_config

LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}
CHATS = [
    {
        "messages": [
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "5"},
        ]
    },
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
        ]
    },
]


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(**kwargs):
    return TransformersModel(
        config=tiny_config(), mixed_precision="no", dtype=torch.float64, seed=0, **kwargs
    )


def _steps(num_steps=3, gas=2, per_micro=3):
    """Micro-batches of features for each optimizer step."""
    return [
        [random_features(per_micro, seed=10 * s + m) for m in range(gas)] for s in range(num_steps)
    ]


def _functional(steps, tx, lora=None, batch=lambda f: pad_collate(f, 0)):
    """The reference: tf.fwd_bwd over each step's micro-batches, then tf.step."""
    model = tf.models.from_hf_config(tiny_config(), seed=0)
    model.module.to(torch.float64)
    if lora:
        model = tf.lora.add_lora(model, lora, "default")
    state = tf.init(model, tx, seed=0)
    losses, norms = [], []
    for micro_batches in steps:
        grads = None
        for feats in micro_batches:
            grads, _ = tf.fwd_bwd(state, batch(feats), accum=grads)
        state, info = tf.step(state, grads)
        losses.append(float(info["loss"]))
        norms.append(float(info["grad_norm"]))
    return losses, norms, tf.unshard(state)


def _class_api(model, steps, gas):
    losses, norms = [], []
    for micro_batches in steps:
        for feats in micro_batches:
            model.forward_backward(inputs=feats)
            norm = model.clip_grad_and_step(max_grad_norm=1.0, gradient_accumulation_steps=gas)
        norms.append(norm)
        losses.append(model.calculate_metric(is_training=True)["loss"])
    return losses, norms, model.get_state_dict()


def _assert_identical(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("kind", ["adamw+cosine", "sgd", "lora", "padding_free"])
def test_class_api_equals_functional_api(kind):
    steps = _steps()
    model = _model()
    lr = 1e-2
    schedule = lr
    lora, batch = None, lambda f: pad_collate(f, 0)
    if kind == "sgd":
        model.set_optimizer("SGD", lr=lr, momentum=0.9)
        opt = tf.optim.sgd(lr, momentum=0.9, weight_decay=0.01)
    else:
        if kind == "adamw+cosine":
            model.set_optimizer("AdamW", lr=lr, weight_decay=0.05, betas=(0.8, 0.99))
            model.set_lr_scheduler(
                "CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=3
            )
            schedule = tf.schedules.warmup_cosine(lr, 1, 3)
            opt = tf.optim.adamw(schedule, b1=0.8, b2=0.99, weight_decay=0.05)
        else:
            model.set_optimizer(torch.optim.AdamW, lr=lr)
            opt = tf.optim.adamw(lr, weight_decay=0.01)
        if kind == "lora":
            model.add_adapter_to_model("default", LoraConfig(**LORA))
            lora = LORA
        if kind == "padding_free":
            model.set_processor("InputProcessor", padding_free=True)
            batch = pack
    tx = tf.optim.chain(tf.optim.clip_by_global_norm(1.0), opt)
    ref_losses, ref_norms, ref_params = _functional(steps, tx, lora, batch)
    losses, norms, params = _class_api(model, steps, gas=2)
    assert losses == ref_losses
    assert norms == ref_norms
    _assert_identical(params, ref_params)


def test_accumulation_steps_after_exactly_n_micro_batches():
    """gas=3: no update after micro-batches 1 and 2, one after 3 (upstream's first sync would
    come at 4), equal to one step on all 3 micro-batches' features in one batch: the loss is
    normalised over the tokens of all of them (float64: same sums in another order, 1e-12)."""
    micro = [random_features(2 + m, seed=m) for m in range(3)]
    model = _model()
    model.set_optimizer("AdamW", lr=1e-2)
    before = model.get_state_dict()
    results = []
    for i, feats in enumerate(micro):
        model.forward_backward(inputs=feats)
        results.append(model.clip_grad_and_step(gradient_accumulation_steps=3))
        if i < 2:
            _assert_identical(model.get_state_dict(), before)
    assert results[0] is None and results[1] is None and isinstance(results[2], float)
    assert model.calculate_metric()["step"] == 1
    tx = tf.optim.chain(tf.optim.clip_by_global_norm(1.0), tf.optim.adamw(1e-2))
    one_batch = [[[f for feats in micro for f in feats]]]
    ref_losses, _, ref_params = _functional(one_batch, tx)
    assert model.calculate_metric()["loss"] == pytest.approx(ref_losses[0], rel=1e-12)
    for name, p in model.get_state_dict().items():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-10, atol=1e-12)
    # A per-micro-batch mean (what a loss averaged before accumulation gives) differs.
    mean_of_means = sum(_functional([[feats]], tx)[0][0] for feats in micro) / len(micro)
    assert abs(mean_of_means - ref_losses[0]) > 1e-6


def test_group_accumulation_default_and_step_gating():
    model = _model()
    model.add_adapter_to_model("a", LORA, gradient_accumulation_steps=2)
    feats = random_features(2)
    model.forward_backward(inputs=feats)
    assert model.clip_grad_norm() is None  # still accumulating: every step-side call waits
    model.step()
    model.zero_grad()
    model.lr_step()
    assert model.state.step == 0
    model.forward_backward(inputs=feats)
    norm = model.clip_grad_norm(max_grad_norm=1e-3)
    model.step()
    assert model.state.step == 1 and model.calculate_metric()["grad_norm"] == pytest.approx(norm)
    model.forward_backward(inputs=feats)
    model.forward_backward(inputs=feats)
    model.zero_grad()  # drops the pending gradients: nothing to step, which step() says
    with pytest.raises(ValueError, match="no accumulated micro-batch"):
        model.step()
    assert model.state.step == 1


def test_fp16_clip_grad_norm_is_the_norm_the_step_reports():
    """fp16 scales the loss (by the state's loss scale, 2**10 at first) before the backward;
    clip_grad_norm divides it out: it returns the grad_norm the step reports for the same
    gradients, and the fp32 run's up to fp16 rounding (the scaled norm is 1024 times that)."""
    feats = random_features(4, seed=8)
    norms = {}
    for precision in ("fp16", "no"):
        model = TransformersModel(config=tiny_config(), mixed_precision=precision, seed=0)
        model.forward_backward(inputs=feats)
        norms[precision] = model.clip_grad_norm(max_grad_norm=1.0)
        if precision == "fp16":
            assert float(model.state.loss_scale.scale) == 2.0**10
        model.step()
        metrics = model.calculate_metric()
        assert metrics["step"] == 1  # the step was made, not skipped for an overflow
        assert norms[precision] == pytest.approx(metrics["grad_norm"], rel=1e-6)
    assert norms["fp16"] == pytest.approx(norms["no"], rel=1e-3)


def test_forward_calculate_loss_backward_equals_forward_backward():
    feats = random_features(4, seed=3)
    split, fused = _model(), _model()
    out = split.forward(inputs=feats)
    loss = split.calculate_loss()
    split.backward()
    fused_out = fused.forward_backward(inputs=feats)
    assert loss == pytest.approx(fused_out["loss"], rel=1e-12)
    assert out["num_tokens"] == fused_out["num_tokens"]
    split.clip_grad_and_step()
    fused.clip_grad_and_step()
    _assert_identical(split.get_state_dict(), fused.get_state_dict())
    with pytest.raises(ValueError, match="forward"):
        split.backward()  # the forward was already backpropagated


@torch.no_grad()
def _reference_logps(module, feats):
    """log_softmax of the HF logits at the labels, one padded row per feature."""
    batch = pad_collate(feats, 0)
    logits = module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"]
    picked = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    return picked.masked_fill(labels == -100, 0.0), batch


@pytest.mark.parametrize("padding_free", [False, True])
def test_logps_and_loss_match_independent_references(padding_free):
    feats = random_features(3, seed=5)
    model = _model()
    model.set_processor("InputProcessor", padding_free=padding_free)
    ref, batch = _reference_logps(model.model, feats)
    out = model.forward_only(inputs=feats, return_logits=True, temperature=1.0)
    assert out.logps.shape == ref.shape  # [n_seq, max_len] either way
    torch.testing.assert_close(out.logps, ref, rtol=1e-12, atol=1e-12)
    fused = tf.evaluate(model.state, batch)  # the fused lm_head + CE kernel
    assert out.loss == pytest.approx(float(fused.loss_sum / fused.num_tokens), rel=1e-12)
    assert out.logits.shape[-1] == tiny_config().vocab_size
    trained = model.forward_backward(inputs=feats, return_logps=True)
    torch.testing.assert_close(trained.logps, ref, rtol=1e-12, atol=1e-12)
    assert trained.loss == pytest.approx(out.loss, rel=1e-12)
    assert "logits" not in trained


def test_disable_lora_gives_base_model_logps():
    feats = random_features(2, seed=6)
    base_logps = _model().forward_only(inputs=feats).logps
    model = _trained(adapter=True)
    assert not torch.allclose(model.forward_only(inputs=feats).logps, base_logps)
    torch.testing.assert_close(
        model.forward_only(inputs=feats, disable_lora=True).logps, base_logps, rtol=0, atol=0
    )
    assert all(p.requires_grad for p in model.state.params.values())


def _trained(steps=2, adapter=False, **kwargs):
    model = _model(**kwargs)
    if adapter:
        model.add_adapter_to_model("a", LORA)
    model.set_optimizer("AdamW", lr=1e-2)
    for micro_batches in _steps(num_steps=steps, gas=1):
        model.forward_backward(inputs=micro_batches[0])
        model.clip_grad_and_step()
    return model


def test_lr_follows_upstream_cosine_warmup_scheduler():
    """The lr of each step equals upstream's CosineWarmupScheduler (a LambdaLR) stepped once
    per optimizer step, computed here from its formula."""
    model = _model()
    model.set_optimizer("AdamW", lr=0.1)
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=2, num_training_steps=5)
    lrs = []
    for _ in range(5):
        model.forward_backward(inputs=random_features(1))
        model.clip_grad_and_step()
        lrs.append(model.calculate_metric()["lr"])

    def upstream(step, warmup=2, total=5):
        if step < warmup:
            return step / warmup
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / (total - warmup))))

    assert lrs == pytest.approx([0.1 * upstream(s) for s in range(5)], rel=1e-12, abs=1e-15)


def test_set_lr_scheduler_after_training_started_keeps_the_optimizer_state():
    model = _trained(steps=1)
    model.set_lr_scheduler("default", lr_decay_steps=10, lr_warmup_steps=0, min_lr=0.0)
    assert int(model.state.opt_state[1].count) == 1
    model.forward_backward(inputs=random_features(1))
    model.clip_grad_and_step()
    assert model.calculate_metric()["lr"] == pytest.approx(
        0.5 * 1e-2 * (1 + math.cos(math.pi * 1 / 10)), rel=1e-12
    )
