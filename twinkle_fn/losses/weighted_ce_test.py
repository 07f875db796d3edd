"""The weighted cross entropy against a float64 reference (value and gradient), against the
default cross entropy with unit scales, and its missing field refused before compute.

Tolerances: float64 end to end, the same terms summed in another order (1e-12).
"""

import pytest
import torch

from twinkle_fn.losses import (
    WeightedCrossEntropy,
    check_loss,
    cross_entropy_sum,
    weighted_cross_entropy,
)
from twinkle_fn.losses.token_loss import inputs_from_logits

IGNORE = -100
EXACT = dict(rtol=1e-12, atol=1e-12)
LOSS = weighted_cross_entropy()


def _problem(shape=(3, 7), vocab=17, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(*shape, vocab, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, vocab, shape, generator=gen)
    labels[torch.rand(shape, generator=gen) < 0.3] = IGNORE
    scale = torch.randint(0, 9, shape, generator=gen).double() / 4  # zeros included
    return logits.requires_grad_(), labels, scale


def test_the_loss_equals_its_float64_reference_in_value_and_gradient():
    logits, labels, scale = _problem()
    out = LOSS(inputs_from_logits(logits, labels, {"loss_scale": scale}, LOSS.needs))
    (grad,) = torch.autograd.grad(out.loss_sum, logits)
    ref_logits = logits.detach().clone().requires_grad_()
    probs = torch.softmax(ref_logits, -1)
    picked = probs.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    want = -(scale * torch.log(picked) * (labels != IGNORE)).sum()
    (want_grad,) = torch.autograd.grad(want, ref_logits)
    torch.testing.assert_close(out.loss_sum, want, **EXACT)
    torch.testing.assert_close(grad, want_grad, **EXACT)
    # a zero scale adds nothing but still counts: the mean is over every supervised token
    assert int(out.num_tokens) == int((labels != IGNORE).sum())
    assert (grad[(scale == 0) | (labels == IGNORE)] == 0).all()


def test_unit_scales_give_the_cross_entropy():
    logits, labels, scale = _problem(seed=1)
    out = LOSS(inputs_from_logits(logits, labels, {"loss_scale": scale * 0 + 1}, LOSS.needs))
    want = cross_entropy_sum(logits, labels)
    torch.testing.assert_close(out.loss_sum, want.loss_sum, **EXACT)
    assert int(out.num_tokens) == int(want.num_tokens)


def test_a_missing_loss_scale_is_named_before_compute():
    assert isinstance(LOSS, WeightedCrossEntropy) and LOSS.fields == ("loss_scale",)
    batch = {"input_ids": torch.ones(1, 3, dtype=torch.int64), "labels": torch.ones(1, 3).long()}
    with pytest.raises(ValueError, match="reads batch field 'loss_scale', which the batch lacks"):
        check_loss(LOSS, batch)
