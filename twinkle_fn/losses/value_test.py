"""The clipped value loss against a piecewise float64 reference, its exact normalisation over
parts of a batch, and the refusals that come before any compute."""

import pytest
import torch

import twinkle_fn as tf
from twinkle_fn.losses import TokenInputs, check_head, check_loss, value_loss
from twinkle_fn.testing import value_reference_sum


def _inputs(seed=0, shape=(4, 9)):
    """float64 values, returns and old values with about a third of the labels ignored."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=g, dtype=torch.float64) * 0.5
    fields = {
        "returns": torch.randn(shape, generator=g, dtype=torch.float64),
        "old_values": values.detach() + torch.randn(shape, generator=g, dtype=torch.float64) * 0.3,
    }
    labels = torch.randint(0, 10, shape, generator=g)
    labels[torch.rand(shape, generator=g) < 0.3] = -100
    return values.requires_grad_(), labels, fields


@pytest.mark.parametrize("clip", [0.2, None])
def test_the_value_loss_equals_its_piecewise_reference_in_value_and_gradient(clip):
    """float64: the same terms, summed in the same order (1e-12)."""
    values, labels, fields = _inputs()
    out = value_loss(clip)(TokenInputs(None, labels, fields, values=values))
    want = value_reference_sum(values, labels, fields, clip)
    torch.testing.assert_close(out.loss_sum, want, rtol=1e-12, atol=1e-12)
    assert int(out.num_tokens) == int((labels != -100).sum())
    (got_grad,) = torch.autograd.grad(out.loss_sum, values)
    (want_grad,) = torch.autograd.grad(want, values)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)
    if clip is not None:  # both branches were exercised: some supervised gradients are 0
        supervised = labels != -100
        assert (got_grad[supervised] == 0).any() and (got_grad[supervised] != 0).any()


def test_the_clip_only_slows_a_value_that_left_its_range():
    """V=1 moved 0.8 above V_old=0.2 (c=0.2): towards R=2 the clipped error (1.6^2) is the
    larger and its gradient 0; away from R=-1 the unclipped error (2^2) counts, gradient V-R."""
    values = torch.tensor([[1.0, 1.0]], dtype=torch.float64, requires_grad=True)
    fields = {
        "returns": torch.tensor([[2.0, -1.0]], dtype=torch.float64),
        "old_values": torch.tensor([[0.2, 0.2]], dtype=torch.float64),
    }
    out = value_loss(0.2)(
        TokenInputs(None, torch.zeros(1, 2, dtype=torch.long), fields, values=values)
    )
    assert float(out.loss_sum.detach()) == pytest.approx(0.5 * (1.6**2 + 2.0**2), rel=1e-12)
    (grad,) = torch.autograd.grad(out.loss_sum, values)
    assert grad.tolist() == [[0.0, 2.0]]


def test_parts_of_a_batch_add_up_to_the_batch():
    """A token sum and a count: two halves give the whole batch's sums (1e-12)."""
    values, labels, fields = _inputs(seed=1)
    loss = value_loss(0.2)
    whole = loss(TokenInputs(None, labels, fields, values=values))
    halves = [
        loss(TokenInputs(None, labels[s], {k: v[s] for k, v in fields.items()}, values=values[s]))
        for s in (slice(0, 2), slice(2, 4))
    ]
    torch.testing.assert_close(sum(h.loss_sum for h in halves), whole.loss_sum, rtol=1e-12, atol=0)
    assert sum(int(h.num_tokens) for h in halves) == int(whole.num_tokens)


def test_an_ignored_token_leaks_nothing():
    values, labels, fields = _inputs(seed=2)
    ignored = labels == -100
    fields["returns"] = fields["returns"].masked_fill(ignored, float("nan"))
    out = value_loss(0.2)(TokenInputs(None, labels, fields, values=values))
    assert torch.isfinite(out.loss_sum)


def test_fields_follow_the_clip():
    assert value_loss().fields == ("returns", "old_values")
    assert value_loss(None).fields == ("returns",)
    assert value_loss().needs == {"values"}


@pytest.mark.parametrize("clip", [0, -0.1, float("inf"), True, "0.2"])
def test_a_bad_clip_is_refused(clip):
    with pytest.raises(ValueError, match="clip must be a positive number or None"):
        value_loss(clip)


def _batch(**fields):
    labels = torch.tensor([[1, 2, -100]])
    return {"input_ids": torch.ones(1, 3, dtype=torch.long), "labels": labels, **fields}


def test_a_missing_field_is_named_with_the_fix():
    with pytest.raises(ValueError, match=r"reads batch field 'old_values'.*give every feature"):
        check_loss(value_loss(), _batch(returns=torch.zeros(1, 3)), head="value")


def test_a_value_loss_needs_a_value_head_and_a_value_head_needs_a_value_loss():
    batch = _batch(returns=torch.zeros(1, 3), old_values=torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"ValueLoss.*no value head.*head='value'"):
        check_loss(value_loss(), batch)
    check_loss(value_loss(), batch, head="value")
    ppo = tf.losses.policy_gradient()
    with pytest.raises(ValueError, match=r"value head.*PolicyGradient.*tf.losses.value_loss"):
        check_loss(ppo, {**batch, "advantages": torch.zeros(1, 3)}, head="value")
    with pytest.raises(ValueError, match="the default cross entropy cannot train it"):
        check_head(None, "value")
    check_head(None, "lm")
