"""The loss seam: per-token terms from logits, the policy-gradient loss against float64
references, and the checks that refuse a loss before any compute.

Tolerances: float64 inputs stay float64 end to end, so the references agree to rounding of sums
of a few dozen terms (1e-12). float32 logits are upcast once; against a float64 reference they
agree to float32 rounding of a log-sum-exp over 17 logits of size ~3 (1e-5).
"""

import math

import pytest
import torch

from twinkle_fn.losses import (
    LossOutput,
    PolicyGradient,
    TokenInputs,
    check_loss,
    cross_entropy_sum,
    policy_gradient,
    token_entropy,
    token_loss,
)
from twinkle_fn.losses.token_loss import TERMS, FunctionLoss, apply_loss, inputs_from_logits

IGNORE = -100
EXACT = dict(rtol=1e-12, atol=1e-12)


def _problem(shape=(3, 7), vocab=17, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(*shape, vocab, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, vocab, shape, generator=gen)
    labels[torch.rand(shape, generator=gen) < 0.3] = IGNORE
    advantages = torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1
    return logits.to(dtype).requires_grad_(), labels, advantages.float()


def _reference(logits, labels, advantages, entropy_coef):
    """The policy-gradient loss written out in float64 over explicit probabilities."""
    logp = torch.log_softmax(logits.double(), dim=-1)  # [B, T, V]
    mask = labels != IGNORE
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [B, T]
    entropy = -(logp.exp() * logp).sum(-1)
    terms = -(advantages.double() * picked) - entropy_coef * entropy
    return (terms * mask).sum(), mask.sum()


@pytest.mark.parametrize("entropy_coef", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_policy_gradient_equals_its_float64_reference_in_value_and_gradient(dtype, entropy_coef):
    logits, labels, advantages = _problem(dtype=dtype)
    loss = policy_gradient(entropy_coef)
    out = loss(inputs_from_logits(logits, labels, {"advantages": advantages}, loss.needs))
    (grad,) = torch.autograd.grad(out.loss_sum, logits)
    ref_logits = logits.detach().double().requires_grad_()
    ref_sum, ref_count = _reference(ref_logits, labels, advantages, entropy_coef)
    (ref_grad,) = torch.autograd.grad(ref_sum, ref_logits)
    tol = EXACT if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    assert isinstance(out, LossOutput)
    assert out.loss_sum.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert out.num_tokens.dtype == torch.int64 and int(out.num_tokens) == int(ref_count) > 0
    torch.testing.assert_close(out.loss_sum.double(), ref_sum.detach(), **tol)
    torch.testing.assert_close(grad.double(), ref_grad, **tol)
    assert (grad[labels == IGNORE] == 0).all()  # an ignored token adds nothing


def test_unit_advantages_give_the_cross_entropy():
    logits, labels, advantages = _problem()
    ones = torch.ones_like(advantages)
    out = policy_gradient()(inputs_from_logits(logits, labels, {"advantages": ones}, frozenset()))
    want = cross_entropy_sum(logits, labels)
    torch.testing.assert_close(out.loss_sum, want.loss_sum, **EXACT)
    assert int(out.num_tokens) == int(want.num_tokens)


def test_the_per_token_terms_are_zero_where_the_label_is_ignored():
    logits, labels, _ = _problem(dtype=torch.float32)
    inputs = inputs_from_logits(logits, labels, {}, frozenset({"entropy"}))
    ignored = labels == IGNORE
    assert inputs.logps.dtype == inputs.entropy.dtype == torch.float32
    assert inputs.logps.shape == inputs.entropy.shape == labels.shape
    assert (inputs.logps[ignored] == 0).all() and (inputs.entropy[ignored] == 0).all()
    assert (inputs.logps[~ignored] < 0).all()
    assert torch.equal(inputs.mask, ~ignored)
    assert inputs_from_logits(logits, labels, {}, frozenset()).entropy is None


def test_token_entropy_is_zero_for_a_certain_token_and_log_vocab_for_a_uniform_one():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [200.0, 0.0, 0.0, 0.0]]], dtype=torch.float64)
    got = token_entropy(logits, torch.tensor([[1, 0]]))
    torch.testing.assert_close(got, torch.tensor([[math.log(4), 0.0]], dtype=torch.float64))


def test_a_non_finite_field_on_an_ignored_token_does_not_leak_into_the_loss():
    _, labels, advantages = _problem()
    advantages[labels == IGNORE] = float("nan")
    out = policy_gradient()(
        TokenInputs(torch.zeros(labels.shape), labels, {"advantages": advantages})
    )
    assert torch.isfinite(out.loss_sum)


def test_a_policy_gradient_needs_the_entropy_only_with_a_bonus():
    assert policy_gradient().needs == frozenset()
    assert policy_gradient(0.01).needs == {"entropy"}
    assert PolicyGradient.fields == ("advantages",)
    for bad in (float("nan"), float("inf"), "0.1", True):
        with pytest.raises(ValueError, match="entropy_coef must be a finite number"):
            policy_gradient(bad)


def _batch(**fields):
    labels = torch.tensor([[1, 2, IGNORE]])
    return {"input_ids": torch.tensor([[1, 2, 3]]), "labels": labels, **fields}


def test_a_loss_made_of_a_function_declares_what_it_reads():
    def weighted(inputs):
        return LossOutput(-(inputs.fields["weights"] * inputs.logps).sum(), inputs.mask.sum())

    loss = token_loss(weighted, fields=["weights"], needs=["entropy"])
    assert loss.fields == ("weights",) and loss.needs == {"entropy"}
    check_loss(loss, _batch(weights=torch.ones(1, 3)))
    out = loss(
        TokenInputs(torch.full((1, 3), -2.0), _batch()["labels"], {"weights": torch.ones(1, 3)})
    )
    assert float(out.loss_sum) == 6.0


def test_a_missing_or_misshapen_field_is_named_before_compute():
    loss = policy_gradient()
    with pytest.raises(ValueError, match=r"reads batch field 'advantages', which the batch lacks"):
        check_loss(loss, _batch(rewards=torch.ones(1, 3)))
    with pytest.raises(ValueError, match=r"'advantages' must be a tensor shaped like labels"):
        check_loss(loss, _batch(advantages=torch.ones(1)))
    with pytest.raises(ValueError, match="no 'labels'"):
        check_loss(loss, {"advantages": torch.ones(1, 3)})


def test_a_sequence_loss_is_checked_by_its_own_check_and_needs_one():
    class Linearisable:
        fields = ()

        def linearise(self, batch, logps):
            raise AssertionError("never reached")

    with pytest.raises(TypeError, match=r"a sequence loss .*`check`"):
        check_loss(Linearisable(), _batch())

    class Refusing(Linearisable):
        def check(self, batch):
            raise ValueError("refused by its check")

    with pytest.raises(ValueError, match="refused by its check"):
        check_loss(Refusing(), _batch())


def test_values_need_a_value_head_and_unknown_terms_are_refused():
    assert {"entropy", "values"} == TERMS

    def critic(inputs):
        raise AssertionError("a loss that needs values must never run")

    wants_values = token_loss(critic, needs=["values"])  # built: refused on an lm head
    with pytest.raises(
        ValueError, match=r"needs 'values'.*this model has no value head.*head='value'"
    ):
        check_loss(wants_values, _batch())
    with pytest.raises(ValueError, match=r"needs \['logits'\], which no backend computes"):
        token_loss(critic, needs=["logits"])


@pytest.mark.parametrize(
    ("loss", "match"),
    [
        (lambda inputs: None, "must be a TokenLoss"),
        ("policy_gradient", "must be a TokenLoss"),
        (FunctionLoss(lambda inputs: None, fields="advantages"), "collection of names"),
    ],
    ids=["no attributes", "a name", "fields as one string"],
)
def test_what_is_not_a_loss_is_refused(loss, match):
    with pytest.raises(TypeError, match=match):
        check_loss(loss, _batch())
    with pytest.raises(TypeError, match="collection of names"):
        token_loss(lambda inputs: None, fields="advantages")


def test_a_loss_must_return_a_loss_output_of_scalars():
    inputs = TokenInputs(torch.zeros(1, 3), _batch()["labels"])
    with pytest.raises(TypeError, match=r"returned .*LossOutput\(loss_sum, num_tokens\)"):
        apply_loss(token_loss(lambda i: (i.logps.sum(), i.mask.sum())), inputs)
    with pytest.raises(TypeError, match="both 0-d tensors"):
        apply_loss(token_loss(lambda i: LossOutput(i.logps, i.mask.sum())), inputs)
