"""A critic step through the value model classes equals the core's, on both backends.

``set_loss('PPOValueLoss', clip=0.2)`` + ``forward_backward(inputs, returns=response-only
lists, old_values=forward_only rows)`` + ``clip_grad_and_step()`` gives the weights of
``tf.fwd_bwd(state, pad_collate(features with per-token returns / old_values),
loss=value_loss(0.2))`` + ``tf.step`` (the class's optimizer, clipped to 1.0) from the same
initial state: float32, the same kernels on the same numbers (every field value is exact in
float32), so bit-identical. The step moves every weight (lr 1e-2 Adam), and the clip binds on
some tokens (the old values are the critic's own, shifted by up to +-0.375 against a 0.2 clip).
`TransformersValueModel` runs padded in one forward, and packed (``padding_free=True``) with
``micro_batch_size=2``; `MegatronValueModel` in one spawned process
(megatron's global state) with ``micro_batch_size=2``, which the core then runs alike.
``forward_only`` gives ``tf.token_values``' rows, ``values`` on megatron's ``forward_backward``
too.

Bad input (returns of the wrong count, a missing ``returns`` or ``old_values``, a field the loss
does not read, a loss that needs log-probabilities) is refused before any compute: each is tried
before the good call, whose step would otherwise differ from the core's.
"""

import pytest
import torch

import twinkle_fn as tf
from twinkle import DeviceMesh
from twinkle.loss import PPOValueLoss, make_loss
from twinkle.model import MegatronValueModel, TransformersValueModel
from twinkle.model import optim as class_optim
from twinkle.processor import unpack
from twinkle_fn.data import pack, pad_collate
from twinkle_fn.losses import value_loss
from twinkle_fn.testing import random_features, tiny_config
from twinkle_fn.testing_dist import spawn

LR = 1e-2
BAD_CALLS = [
    (dict(returns=[1.0, 2.0]), ValueError, r"PPOValueLoss.*returns has 2 entries for 4"),
    (dict(returns=None), ValueError, r"PPOValueLoss.*needs returns.*pass returns="),
    (dict(old_values=None), ValueError, r"needs old_values.*forward_only.*clip=None"),
    (dict(advantages=[0.0] * 4), TypeError, r"got \['advantages'\], which the loss PPOValueLoss"),
]


def _features():
    return random_features(4, seed=11)


def _returns(features):
    """Response-only per-token lists (a GAE computation's form), exact in float32."""
    return [
        [((i + t) % 9 - 4) / 8 for t, label in enumerate(f["labels"]) if label != -100]
        for i, f in enumerate(features)
    ]


def _old_values(values):
    """The critic's own values shifted by -0.375 .. 0.375, rounded to multiples of 1/1024, so
    the 0.2 clip binds on some tokens."""
    shift = (torch.arange(values.numel()).view_as(values) % 7 - 3) / 8
    return torch.round((values + shift) * 1024) / 1024


def _core_features(features, old):
    """`features` with the per-token fields the core's loss reads, written out by hand."""
    out = []
    for f, r, o in zip(features, _returns(features), old, strict=True):
        supervised = iter(r)
        returns = [next(supervised) if x != -100 else 0.0 for x in f["labels"]]
        out.append({**f, "returns": returns, "old_values": o[: len(f["input_ids"])].tolist()})
    return out


def _train_through_the_class(model, micro_batch_size=None):
    """The bad calls, a policy loss, then one good value-loss call and step."""
    feats = _features()
    model.set_loss("PPOValueLoss", clip=0.2)
    values = model.forward_only(inputs=feats)  # [4, max_len]
    old = _old_values(values["values"])
    good = dict(returns=_returns(feats), old_values=old)
    for bad, error, match in BAD_CALLS:
        with pytest.raises(error, match=match):
            model.forward_backward(inputs=feats, **{**good, **bad})
    model.set_loss("GRPOLoss")
    with pytest.raises(ValueError, match=r"value head.*cannot train it"):
        model.forward_backward(inputs=feats, advantages=[1.0] * 4, old_logps=[0.0] * 4)
    model.set_loss("PPOValueLoss", clip=0.2)
    out = model.forward_backward(inputs=feats, **good, micro_batch_size=micro_batch_size)
    model.clip_grad_and_step()
    return tf.unshard(model.state), values, old, out


def _collate(features, packed):
    return pack(features) if packed else pad_collate(features, 0)


def _train_through_the_core(state, old, micro_batch_size=4, packed=False):
    """One value-loss step over micro-batches of `micro_batch_size` features (packed or
    padded). Returns the weights, the loss (token sum over token count) and the values before
    the step, ``[4, max_len]``."""
    feats = _core_features(_features(), old)
    whole = _collate(_features(), packed)
    values = unpack(tf.token_values(state, whole)["values"], whole)
    grads, loss_sum, num_tokens = None, 0.0, 0
    for i in range(0, len(feats), micro_batch_size):
        batch = _collate(feats[i : i + micro_batch_size], packed)
        grads, aux = tf.fwd_bwd(state, batch, accum=grads, loss=value_loss(0.2))
        loss_sum, num_tokens = loss_sum + aux["loss_sum"], num_tokens + aux["num_tokens"]
    state, _ = tf.step(state, grads)
    return tf.unshard(state), float(loss_sum / num_tokens), values


def _check(via_class, via_core, initial):
    assert via_class.keys() == via_core.keys()
    assert {"score.weight", "score.bias"} <= via_core.keys()
    for name, want in via_core.items():
        assert torch.equal(via_class[name], want), name
    moved = [float((via_core[n] - initial[n]).abs().max()) for n in via_core]
    assert min(moved) > 1e-3  # every weight moved, the head too


def _check_outputs(values, core_values, out, core_loss):
    assert torch.equal(values["values"], core_values)  # [4, max_len]
    n = sum(x != -100 for f in _features() for x in f["labels"])
    assert values["num_tokens"] == n == out["num_tokens"]
    assert out["loss"] == pytest.approx(core_loss, rel=1e-6)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed_micro_batches"])
def test_transformers_value_model_step_equals_the_core(packed):
    """Padded in one forward; or packed (``padding_free=True``) in two micro-batches of two
    samples, which the core then runs alike."""

    def model():
        m = TransformersValueModel(config=tiny_config(), mixed_precision="no", seed=0)
        m.set_optimizer("AdamW", lr=LR)
        m.set_processor("InputProcessor", padding_free=packed)
        return m

    micro = 2 if packed else None
    initial = tf.unshard(model().state)
    via_class, values, old, out = _train_through_the_class(model(), micro_batch_size=micro)
    state = model().state
    tx = class_optim.transform(class_optim.optimizer_spec("AdamW", lr=LR), LR, 1.0)
    via_core, core_loss, core_values = _train_through_the_core(
        state.replace(tx=tx), old, micro or 4, packed
    )
    _check(via_class, via_core, initial)
    _check_outputs(values, core_values, out, core_loss)
    assert "logps" not in out


def _megatron_runs():
    def model():
        m = MegatronValueModel(
            config=tiny_config(),
            device_mesh=DeviceMesh.from_sizes(world_size=1),
            mixed_precision="no",
            seed=0,
        )
        m.set_optimizer("default", lr=LR)  # megatron's optimizer clips to its clip_grad, 1.0
        return m

    initial = tf.unshard(model().state)
    via_class, values, old, out = _train_through_the_class(model(), micro_batch_size=2)
    via_core, core_loss, core_values = _train_through_the_core(model().state, old, 2)
    return via_class, via_core, initial, values, core_values, out, core_loss


def test_megatron_value_model_step_equals_the_core():
    via_class, via_core, initial, values, core_values, out, loss = spawn(
        _megatron_runs, 1, timeout_s=300
    )[0]
    _check(via_class, via_core, initial)
    _check_outputs(values, core_values, out, loss)
    assert out["values"].shape == values["values"].shape  # the training forward's values


def test_the_value_loss_by_name_and_called_as_upstreams():
    """``make_loss`` resolves it; called on given values it is the core's token mean."""
    assert isinstance(make_loss("PPOValueLoss", clip=0.5), PPOValueLoss)
    assert make_loss("ppo_value").clip == 0.2
    labels = torch.tensor([[-100, 1, 2, 3]])
    values = torch.tensor([[0.0, 0.5, -0.25, 1.0]])
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    out = PPOValueLoss(clip=0.2)(
        {"labels": labels}, {"values": values}, returns=[1.0], old_values=old
    )
    # per token: max((V-R)^2, (clip(V)-R)^2) = 0.64 (0.5 clipped to 0.2), 1.5625, 0.64 (1 -> 0.2)
    assert float(out["loss"]) == pytest.approx(0.5 * (0.64 + 1.5625 + 0.64) / 3, rel=1e-6)
    with pytest.raises(ValueError, match="needs old_values"):
        PPOValueLoss(clip=0.2)({"labels": labels}, {"values": values}, returns=[1.0])
    with pytest.raises(ValueError, match="clip must be a positive number"):
        PPOValueLoss(clip=-1)
    with pytest.raises(ValueError, match="token-classification model"):
        TransformersValueModel(model_cls="AutoModelForCausalLM", config=tiny_config())
