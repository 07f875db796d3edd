"""DPO through the class API equals DPO through the core, on both model classes.

``set_loss('DPOLoss', beta=0.1)`` + ``forward_backward(inputs=pairs, ref_logps=response-only
lists)`` + ``step()`` gives the weights of ``tf.fwd_bwd(state, pad_collate(pairs with per-token
ref_logps), loss=dpo_loss(0.1))`` + ``tf.step`` from the same initial state, on the same
micro-batches. Float32, the same kernels on the same numbers (every reference value is exact in
float32): held to rtol 1e-6 / atol 1e-7 (observed bit-identical on `TransformersModel`); the
lr 1e-2 Adam step moves every weight by about 1e-2. `TransformersModel` runs padded in one
forward, and packed (``padding_free=True``) in micro-batches of one pair; `MegatronModel` runs
in one spawned process with micro-batches of one pair. The returned loss is the mean over the
call's pairs, the core's ``loss_sum / num_tokens`` (its count is pairs). ``reference_free``
equals the core's DPO with zero references.

Bad input (a micro-batch that splits a pair, no ``ref_logps``, a ``ref_outputs`` without
``logps``) is refused before any compute: each is tried before the good call, whose step would
otherwise differ from the core's.
"""

import pytest
import torch

import twinkle_fn as tf
from twinkle import DeviceMesh
from twinkle.model import MegatronModel, TransformersModel
from twinkle_fn.data import pack, pad_collate
from twinkle_fn.losses import dpo_loss
from twinkle_fn.testing import random_features, tiny_config
from twinkle_fn.testing_dist import spawn

LR, RTOL, ATOL, BETA = 1e-2, 1e-6, 1e-7, 0.1
BAD_CALLS = [
    (dict(micro_batch_size=1), r"the batch has 1 (rows|packed samples), an odd number"),
    (dict(ref_logps=None), r"DPOLoss.*needs ref_logps.*disable_lora=True"),
    (dict(ref_logps=None, ref_outputs={"loss": 0.0}), r"ref_outputs must be a forward_only"),
]


def _pairs():
    """Two pairs, interleaved [chosen_0, rejected_0, chosen_1, rejected_1]."""
    return random_features(4, seed=11)


def _ref_logps(features):
    """Response-only per-token lists (the reference's), exact in float32."""
    return [
        [-2.0 - (i + t) % 5 / 8 for t, label in enumerate(f["labels"]) if label != -100]
        for i, f in enumerate(features)
    ]


def _core_features(features):
    """`features` with per-token ``ref_logps`` written out by hand (0 off the responses)."""
    out = []
    for f, ref in zip(features, _ref_logps(features), strict=True):
        supervised = iter(ref)
        row = [next(supervised) if x != -100 else 0.0 for x in f["labels"]]
        out.append({**f, "ref_logps": row})
    return out


def _train_through_the_class(model, micro_batch_size=None):
    """The bad calls, then one good DPO call and step. Returns the weights and the output."""
    feats = _pairs()
    model.set_loss("DPOLoss", beta=BETA)
    good = dict(ref_logps=_ref_logps(feats), micro_batch_size=micro_batch_size)
    for bad, match in BAD_CALLS:
        with pytest.raises(ValueError, match=match):
            model.forward_backward(inputs=feats, **{**good, **bad})
    out = model.forward_backward(inputs=feats, **good)
    model.step()
    return tf.unshard(model.state), out


def _train_through_the_core(state, micro_batch_size=4, collate=pad_collate):
    """One step of ``dpo_loss`` over micro-batches of `micro_batch_size` features. Returns the
    weights and the loss (mean over pairs)."""
    feats = _core_features(_pairs())
    grads, loss_sum, pairs = None, 0.0, 0
    for i in range(0, len(feats), micro_batch_size):
        part = feats[i : i + micro_batch_size]
        batch = pack(part) if collate is pack else pad_collate(part, 0)
        grads, aux = tf.fwd_bwd(state, batch, accum=grads, loss=dpo_loss(BETA))
        loss_sum, pairs = loss_sum + aux["loss_sum"], pairs + aux["num_tokens"]
    assert int(pairs) == 2
    state, _ = tf.step(state, grads)
    return tf.unshard(state), float(loss_sum / pairs)


def _check(via_class, via_core, initial):
    assert via_class.keys() == via_core.keys()
    for name, want in via_core.items():
        torch.testing.assert_close(via_class[name], want, rtol=RTOL, atol=ATOL, msg=name)
    moved = [float((via_core[n] - initial[n]).abs().max()) for n in via_core]
    assert min(moved) > 1e-3  # every weight moved


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed_micro_batches"])
def test_transformers_model_dpo_step_equals_the_core(packed):
    def model():
        m = TransformersModel(config=tiny_config(), mixed_precision="no", seed=0)
        m.set_optimizer("AdamW", lr=LR)
        m.set_processor("InputProcessor", padding_free=packed)
        return m

    micro = 2 if packed else None
    initial = tf.unshard(model().state)
    via_class, out = _train_through_the_class(model(), micro_batch_size=micro)
    via_core, core_loss = _train_through_the_core(
        model().state, micro or 4, pack if packed else pad_collate
    )
    _check(via_class, via_core, initial)
    assert out["loss"] == pytest.approx(core_loss, rel=1e-6)
    assert out["num_tokens"] == 2  # the loss's count: pairs


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
    via_class, out = _train_through_the_class(model(), micro_batch_size=2)
    via_core, core_loss = _train_through_the_core(model().state, micro_batch_size=2)
    return via_class, via_core, initial, out, core_loss


def test_megatron_model_dpo_step_equals_the_core():
    via_class, via_core, initial, out, core_loss = spawn(_megatron_runs, 1, timeout_s=300)[0]
    _check(via_class, via_core, initial)
    assert out["loss"] == pytest.approx(core_loss, rel=1e-6)
    assert out["num_tokens"] == 2


def test_reference_free_dpo_step_equals_the_core_with_zero_references():
    """``DPOLoss(reference_free=True)`` reads no reference: the class feeds the core's
    ``dpo_loss(reference='sequences')`` zeros (``R = 0``)."""

    def model():
        m = TransformersModel(config=tiny_config(), mixed_precision="no", seed=0)
        m.set_optimizer("AdamW", lr=LR)
        return m

    via_class = model()
    via_class.set_loss("DPOLoss", beta=BETA, reference_free=True)
    with pytest.raises(ValueError, match="reads no reference; drop"):
        via_class.forward_backward(inputs=_pairs(), ref_logps=_ref_logps(_pairs()))
    via_class.forward_backward(inputs=_pairs())
    via_class.step()
    state = model().state
    batch = pad_collate([{**f, "ref_seq_logps": 0.0} for f in _pairs()], 0)
    grads, _ = tf.fwd_bwd(state, batch, loss=dpo_loss(BETA, reference="sequences"))
    state, _ = tf.step(state, grads)
    _check(tf.unshard(via_class.state), tf.unshard(state), tf.unshard(model().state))
