"""The PPO / GRPO clipped surrogate against a piecewise float64 reference (value and gradient),
its aggregations across micro-batches, and the errors that refuse it before compute.

Tolerances: float64 end to end, the same terms summed in another order (1e-12).
"""

import pytest
import torch

from twinkle_fn.losses import ClippedSurrogate, aggregation_weights, check_loss, ppo_loss
from twinkle_fn.losses.token_loss import TokenInputs, inputs_from_logits
from twinkle_fn.testing import ppo_reference_terms

IGNORE = -100
EXACT = dict(rtol=1e-12, atol=1e-12)
CONFIGS = {
    "clip": ppo_loss(0.2),
    "clip-higher": ppo_loss(0.2, 0.28),
    "k1": ppo_loss(0.2, beta=0.1, kl_estimator="k1"),
    "k3-entropy": ppo_loss(0.1, 0.3, beta=0.05, entropy_coef=0.01),
    "tis": ppo_loss(0.2, tis_cap=1.5),
    "seq-mean": ppo_loss(0.2, aggregation="seq_mean_token_mean"),
    "dr-grpo-all": ppo_loss(
        0.2, 0.28, beta=0.1, entropy_coef=0.01, tis_cap=2.0, aggregation="dr_grpo"
    ),
}


def _problem(shape=(4, 9), vocab=13, seed=0):
    """Logits and fields where about half the ratios fall outside the clip range."""
    gen = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(*shape, vocab, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, vocab, shape, generator=gen)
    labels[torch.rand(shape, generator=gen) < 0.25] = IGNORE
    logp = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    noise = lambda: 0.4 * torch.randn(shape, generator=gen, dtype=torch.float64)  # noqa: E731
    fields = {
        "advantages": torch.randn(shape, generator=gen, dtype=torch.float64),
        "old_logps": logp + noise(),
        "ref_logps": logp + noise(),
        "rollout_logps": logp + noise(),
        "loss_weights": torch.rand(shape, generator=gen, dtype=torch.float64) + 0.5,
    }
    return logits.requires_grad_(), labels, fields


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_loss_equals_its_piecewise_float64_reference_in_value_and_gradient(name):
    loss = CONFIGS[name]
    logits, labels, fields = _problem()
    mine = {k: fields[k] for k in loss.fields}
    out = loss(inputs_from_logits(logits, labels, mine, loss.needs))
    (grad,) = torch.autograd.grad(out.loss_sum, logits)
    ref_logits = logits.detach().clone().requires_grad_()
    logp_all = torch.log_softmax(ref_logits, -1)
    logp = logp_all.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    mask = labels != IGNORE
    want = (ppo_reference_terms(logp, entropy, mine, loss) * mask).sum()
    (want_grad,) = torch.autograd.grad(want, ref_logits)
    assert int(out.num_tokens) == int(mask.sum())
    torch.testing.assert_close(out.loss_sum, want.detach(), **EXACT)
    torch.testing.assert_close(grad, want_grad, **EXACT)
    assert (grad[~mask] == 0).all()


def test_the_clip_binds_where_it_should_and_nowhere_else():
    """One token per case: a binding clip gives a constant term (no gradient)."""
    loss = ppo_loss(0.2, 0.3)
    old = torch.zeros(1, 6, dtype=torch.float64)
    ratios = torch.tensor([[1.5, 1.1, 0.5, 0.9, 1.5, 0.5]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0, 1.0]], dtype=torch.float64)
    logps = ratios.log().requires_grad_()
    out = loss(
        TokenInputs(
            logps, torch.zeros(1, 6, dtype=torch.int64), {"advantages": adv, "old_logps": old}
        )
    )
    (grad,) = torch.autograd.grad(out.loss_sum, logps)
    # clipped at 1.3 and 0.8 where the sign of A makes the clip binding; the rest is -A * r
    want = torch.tensor([[-1.3, -1.1, 0.8, 0.9, 1.5, -0.5]], dtype=torch.float64)
    torch.testing.assert_close(out.loss_sum, want.sum(), **EXACT)
    want_grad = torch.tensor([[0, -1.1, 0, 0.9, 1.5, -0.5]], dtype=torch.float64)
    torch.testing.assert_close(grad, want_grad, **EXACT)


@pytest.mark.parametrize("aggregation", ["seq_mean_token_mean", "dr_grpo"])
def test_weighted_token_means_are_the_aggregations_for_any_split(aggregation):
    """The weights of `aggregation_weights` turn the seam's token mean (sums and counts added
    over micro-batches, one division) into the sequence mean of token means / Dr. GRPO's
    constant normaliser, whichever rows each micro-batch holds."""
    loss = ppo_loss(0.2, aggregation=aggregation)
    logits, labels, fields = _problem(shape=(5, 8), seed=3)
    labels[:, 0] = 0  # every row has a supervised token
    lengths = [int(n) for n in (labels != IGNORE).sum(1)]
    weights = aggregation_weights(lengths, aggregation, max_tokens=8)
    fields["loss_weights"] = torch.tensor(weights, dtype=torch.float64)[:, None].expand(5, 8)
    terms = ppo_reference_terms(
        torch.log_softmax(logits.detach(), -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0],
        torch.zeros(5, 8, dtype=torch.float64),
        {**fields, "loss_weights": torch.ones(5, 8, dtype=torch.float64)},
        ClippedSurrogate(),
    ) * (labels != IGNORE)
    if aggregation == "dr_grpo":
        want = terms.sum() / (5 * 8)
    else:
        want = (terms.sum(1) / torch.tensor(lengths)).mean()
    sums, counts = 0.0, 0
    for rows in (slice(0, 2), slice(2, 3), slice(3, 5)):
        part = {k: v[rows] for k, v in fields.items() if k in loss.fields}
        out = loss(inputs_from_logits(logits.detach()[rows], labels[rows], part, loss.needs))
        sums, counts = sums + out.loss_sum, counts + int(out.num_tokens)
    torch.testing.assert_close(sums / counts, want, **EXACT)


def test_aggregation_weights():
    assert aggregation_weights([2, 4], "token_mean") == [1.0, 1.0]
    assert aggregation_weights([2, 4], "seq_mean_token_mean") == [1.5, 0.75]
    assert aggregation_weights([2, 4], "dr_grpo", max_tokens=6) == [0.5, 0.5]
    with pytest.raises(ValueError, match="'dr_grpo' needs max_tokens"):
        aggregation_weights([2, 4], "dr_grpo")
    with pytest.raises(ValueError, match="counts >= 1"):
        aggregation_weights([2, 0], "seq_mean_token_mean")
    with pytest.raises(ValueError, match="aggregation must be one of"):
        aggregation_weights([2], "seq_mean")


def test_the_fields_follow_the_options():
    assert ppo_loss().fields == ("advantages", "old_logps")
    assert ppo_loss().epsilon_high == 0.2 and ppo_loss(0.1, 0.3).epsilon_high == 0.3
    assert CONFIGS["dr-grpo-all"].fields == (
        "advantages",
        "old_logps",
        "ref_logps",
        "rollout_logps",
        "loss_weights",
    )
    assert ppo_loss().needs == frozenset() and CONFIGS["k3-entropy"].needs == {"entropy"}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"epsilon": 0.0}, "epsilon must be a positive number"),
        ({"epsilon": 1.0}, "epsilon must be below 1"),
        ({"epsilon_high": -0.1}, "epsilon_high must be a positive number"),
        ({"beta": -1.0}, "beta must be a finite number >= 0"),
        ({"entropy_coef": float("nan")}, "entropy_coef must be a finite number"),
        ({"tis_cap": 0}, "tis_cap must be a positive number"),
        ({"kl_estimator": "k2"}, "kl_estimator must be one of"),
        ({"aggregation": "sum"}, "aggregation must be one of"),
    ],
)
def test_bad_options_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ppo_loss(**kwargs)


def test_a_missing_or_misshapen_field_is_named_with_its_fix_before_compute():
    labels = torch.zeros(2, 3, dtype=torch.int64)
    batch = {"labels": labels, "advantages": torch.ones(2, 3), "old_logps": torch.zeros(2, 3)}
    with pytest.raises(ValueError, match=r"ClippedSurrogate.*'ref_logps', which the batch lacks"):
        check_loss(ppo_loss(beta=0.1), batch)
    inputs = TokenInputs(torch.zeros(2, 3), labels, batch)
    with pytest.raises(ValueError, match=r"ClippedSurrogate.*'ref_logps'.*beta > 0 needs"):
        ppo_loss(beta=0.1)(inputs)
    with pytest.raises(ValueError, match=r"'rollout_logps'.*tis_cap=None"):
        ppo_loss(tis_cap=2.0)(inputs)
    bad = TokenInputs(torch.zeros(2, 3), labels, {**batch, "old_logps": torch.zeros(2, 4)})
    with pytest.raises(ValueError, match=r"field 'old_logps' is shaped \(2, 4\), labels \(2, 3\)"):
        ppo_loss()(bad)
