"""GRPO through the class API equals GRPO through the core, on both model classes.

``set_loss('GRPOLoss', epsilon=0.2, beta=0.04)`` + ``forward_backward(inputs, advantages=per
sample, old_logps=response-only lists, ref_logps=forward_only rows)`` + ``step()`` gives the
weights of ``tf.fwd_bwd(state, pad_collate(features with per-token fields and the sequence-mean
loss_weights), loss=ppo_loss(0.2, beta=0.04, aggregation='seq_mean_token_mean'))`` +
``tf.step`` from the same initial state. Float32, the same kernels on the same numbers (every
field value is exact in float32): held to rtol 1e-6 / atol 1e-7 (observed bit-identical); the
step moves every weight checked by far more (lr 1e-2 Adam: about 1e-2 per weight), and a step
with the cross entropy lands elsewhere. `TransformersModel` runs padded in one forward, and
packed (``padding_free=True``, upstream's cookbook) with ``micro_batch_size=2``; `MegatronModel`
runs in one spawned process (megatron's global state) with ``micro_batch_size=2``. The core
runs the same micro-batches; the sequence weights cover the whole call either way.

Bad input (advantages of the wrong count, a missing ``old_logps``, ``beta > 0`` without
``ref_logps``, a field the loss does not read) is refused before any compute: each is tried
before the good call, whose step would otherwise differ from the core's.
"""

import pytest
import torch

import twinkle_fn as tf
from twinkle import DeviceMesh
from twinkle.model import MegatronModel, TransformersModel
from twinkle_fn.data import pack, pad_collate
from twinkle_fn.losses import aggregation_weights, ppo_loss
from twinkle_fn.testing import random_features, tiny_config
from twinkle_fn.testing_dist import spawn

LR, RTOL, ATOL = 1e-2, 1e-6, 1e-7
ADVANTAGES = [1.0, -0.5, 0.25, -1.0]
BAD_CALLS = [
    (dict(advantages=[1.0, 2.0]), ValueError, r"GRPOLoss.*advantages has 2 entries for 4"),
    (dict(old_logps=None), ValueError, r"GRPOLoss.*needs old_logps.*pass old_logps="),
    (dict(ref_logps=None), ValueError, r"beta=0\.04.*needs ref_logps.*disable_lora=True"),
    (dict(values=[0.0] * 4), TypeError, r"got \['values'\], which the loss GRPOLoss"),
]


def _features():
    return random_features(4, seed=11)


def _old_logps(features):
    """Response-only per-token lists (a sampler's form), exact in float32."""
    return [
        [-3.0 - (i + t) % 7 / 8 for t, label in enumerate(f["labels"]) if label != -100]
        for i, f in enumerate(features)
    ]


def _core_features(features, old, ref):
    """`features` with the per-token fields the core's loss reads, written out by hand."""
    lengths = [sum(x != -100 for x in f["labels"]) for f in features]
    weights = aggregation_weights(lengths, "seq_mean_token_mean")
    out = []
    for f, a, o, r, w in zip(features, ADVANTAGES, old, ref, weights, strict=True):
        supervised = iter(o)
        per_token_old = [next(supervised) if x != -100 else 0.0 for x in f["labels"]]
        n = len(f["input_ids"])
        fields = dict(advantages=a, old_logps=per_token_old, ref_logps=r[:n].tolist())
        out.append({**f, **fields, "loss_weights": w})
    return out


def _train_through_the_class(model, micro_batch_size=None):
    """The bad calls, then one good GRPO call and step. Returns the model's weights."""
    feats = _features()
    model.set_loss("GRPOLoss", epsilon=0.2, beta=0.04)
    ref = model.forward_only(inputs=feats)["logps"]  # [4, max_len]
    good = dict(advantages=ADVANTAGES, old_logps=_old_logps(feats), ref_logps=ref)
    for bad, error, match in BAD_CALLS:
        with pytest.raises(error, match=match):
            model.forward_backward(inputs=feats, **{**good, **bad})
    out = model.forward_backward(inputs=feats, **good, micro_batch_size=micro_batch_size)
    model.step()
    return tf.unshard(model.state), ref, out


def _train_through_the_core(state, ref, micro_batch_size=4, collate=pad_collate):
    """One step over micro-batches of `micro_batch_size` features, the sequence weights taken
    over all four. Returns the weights and the loss (token sum over token count)."""
    feats = _core_features(_features(), _old_logps(_features()), ref)
    loss = ppo_loss(0.2, beta=0.04, aggregation="seq_mean_token_mean")
    grads, loss_sum, num_tokens = None, 0.0, 0
    for i in range(0, len(feats), micro_batch_size):
        part = feats[i : i + micro_batch_size]
        batch = pack(part) if collate is pack else pad_collate(part, 0)
        grads, aux = tf.fwd_bwd(state, batch, accum=grads, loss=loss)
        loss_sum, num_tokens = loss_sum + aux["loss_sum"], num_tokens + aux["num_tokens"]
    state, _ = tf.step(state, grads)
    return tf.unshard(state), float(loss_sum / num_tokens)


def _cross_entropy_step(model):
    model.forward_backward(inputs=_features())
    model.step()
    return tf.unshard(model.state)


def _check(via_class, via_core, initial, ce):
    assert via_class.keys() == via_core.keys()
    for name, want in via_core.items():
        torch.testing.assert_close(via_class[name], want, rtol=RTOL, atol=ATOL, msg=name)
    moved = [float((via_core[n] - initial[n]).abs().max()) for n in via_core]
    assert min(moved) > 1e-3  # every weight moved
    assert any(not torch.allclose(ce[n], via_core[n], atol=1e-4) for n in ce)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed_micro_batches"])
def test_transformers_model_grpo_step_equals_the_core(packed):
    """Padded in one forward; or packed (upstream's cookbook: padding_free=True) in two
    micro-batches of two samples, which the core then runs alike."""

    def model():
        m = TransformersModel(config=tiny_config(), mixed_precision="no", seed=0)
        m.set_optimizer("AdamW", lr=LR)
        m.set_processor("InputProcessor", padding_free=packed)
        return m

    micro = 2 if packed else None
    initial = tf.unshard(model().state)
    via_class, ref, out = _train_through_the_class(model(), micro_batch_size=micro)
    via_core, core_loss = _train_through_the_core(
        model().state, ref, micro or 4, pack if packed else pad_collate
    )
    _check(via_class, via_core, initial, _cross_entropy_step(model()))
    assert out["loss"] == pytest.approx(core_loss, rel=1e-6)
    assert out["num_tokens"] == sum(x != -100 for f in _features() for x in f["labels"])


def _megatron_runs():
    def model():
        m = MegatronModel(
            config=tiny_config(),
            device_mesh=DeviceMesh.from_sizes(world_size=1),
            mixed_precision="no",
            seed=0,
        )
        m.set_optimizer("default", lr=LR, clip_grad=1e9)
        return m

    initial = tf.unshard(model().state)
    via_class, ref, out = _train_through_the_class(model(), micro_batch_size=2)
    via_core, core_loss = _train_through_the_core(model().state, ref, micro_batch_size=2)
    return via_class, via_core, initial, _cross_entropy_step(model()), out, core_loss


def test_megatron_model_grpo_step_equals_the_core():
    via_class, via_core, initial, ce, out, core_loss = spawn(_megatron_runs, 1, timeout_s=300)[0]
    _check(via_class, via_core, initial, ce)
    assert out["loss"] == pytest.approx(core_loss, rel=1e-6)
    assert out["logps"].shape[0] == 4
