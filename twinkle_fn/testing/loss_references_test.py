"""The loss references' formulas on hand-made numbers (no model): the PPO surrogate's branches,
the clipped value loss, and the DPO / SimPO pair losses, each against its closed form.
Float64 throughout; the closed forms are computed in float64 too, so 1e-12 bounds rounding."""

import math

import pytest
import torch

from twinkle_fn.losses import dpo_loss, ppo_loss, simpo_loss
from twinkle_fn.testing.loss_references import (
    ppo_reference_terms,
    preference_reference_losses,
    value_reference_sum,
)

F64 = torch.float64


def test_the_ppo_terms_clip_exactly_where_the_clip_binds_and_stop_its_gradient():
    ratio = torch.tensor([[1.5, 1.1, 0.5, 0.9]], dtype=F64)
    logp = torch.log(ratio).requires_grad_()
    fields = {"advantages": torch.tensor([[1.0, 1.0, -1.0, -1.0]]), "old_logps": torch.zeros(1, 4)}
    loss = ppo_loss(epsilon=0.2, epsilon_high=0.3)
    terms = ppo_reference_terms(logp, torch.zeros_like(logp), fields, loss)
    # bound at 1 + 0.3 (good token pushed up), free, bound at 1 - 0.2 (bad token pushed down), free
    expected = torch.tensor([[-1.3, -1.1, 0.8, 0.9]], dtype=F64)
    torch.testing.assert_close(terms, expected, rtol=0, atol=1e-12)
    (grad,) = torch.autograd.grad(terms.sum(), logp)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -1.1, 0.0, 0.9]], dtype=F64))


@pytest.mark.parametrize(("clip", "expected"), [(None, 0.5 * 1.25), (0.2, 0.5 * 1.26)])
def test_the_value_sum_takes_the_larger_error_outside_the_clip_and_skips_masked_tokens(
    clip, expected
):
    values = torch.tensor([[0.5, 0.0, 1.0, 9.0]], dtype=F64)
    labels = torch.tensor([[1, 1, 1, -100]])
    old = torch.tensor([[0.0, 0.3, 0.0, 0.0]], dtype=F64)  # float64, as the references read it
    fields = {"returns": torch.zeros(1, 4, dtype=F64), "old_values": old}
    # clip 0.2: token 0 keeps its own error 0.25 (larger), token 1 takes the clipped 0.1**2
    got = value_reference_sum(values, labels, fields, clip)
    assert abs(float(got) - expected) < 1e-12


def test_the_pair_losses_are_the_dpo_and_simpo_formulas():
    sums = torch.tensor([-2.0, -6.0], dtype=F64)  # chosen, rejected
    lengths = torch.tensor([2.0, 3.0], dtype=F64)
    simpo = preference_reference_losses(sums, lengths, None, simpo_loss(beta=2.5, gamma=0.5))
    margin = 2.5 * (-2.0 / 2 + 6.0 / 3) - 0.5
    assert abs(float(simpo[0]) + math.log(1 / (1 + math.exp(-margin)))) < 1e-12
    ref = torch.tensor([-3.0, -4.0], dtype=F64)
    dpo = preference_reference_losses(sums, lengths, ref, dpo_loss(0.1, label_smoothing=0.1))
    z = 0.1 * ((-2.0 + 3.0) - (-6.0 + 4.0))

    def log_sigmoid(x):
        return -math.log1p(math.exp(-x))

    assert abs(float(dpo[0]) - (-0.9 * log_sigmoid(z) - 0.1 * log_sigmoid(-z))) < 1e-12
