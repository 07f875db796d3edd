"""The GRPO family, called as upstream's, equals upstream's aggregation of the core's float64
piecewise reference terms (`twinkle_fn.testing.ppo_reference_terms`) in value and gradient;
per-sample data aligns in each of upstream's forms; bad input is refused.

Float64 throughout: the same operations in another order, so 1e-12.
"""

import pytest
import torch

from twinkle.loss import BNPOLoss, DRGRPOLoss, GRPOLoss, LossInputError, PPOLoss, make_loss
from twinkle_fn.testing import ppo_reference_terms

B, T, V, TOL = 3, 6, 11, 1e-12


def _batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, V, dtype=torch.float64, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, :2] = labels[1, :3] = -100  # prompts of different lengths
    labels[2, 5] = -100
    logps = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    logps = logps.masked_fill(labels == -100, 0.0)
    old = logps.detach() + 0.3 * torch.randn(B, T, dtype=torch.float64, generator=g)
    ref = logps.detach() + 0.2 * torch.randn(B, T, dtype=torch.float64, generator=g)
    adv = torch.tensor([1.0, -0.5, 0.25], dtype=torch.float64)
    return logits, labels, logps, old, ref, adv


def _reference(loss, logps, labels, old, ref, adv, aggregation):
    """Upstream's aggregation of the reference terms (mask, per-row and batch means)."""
    mask = (labels != -100).double()
    fields = {"advantages": adv[:, None].expand(B, T), "old_logps": old, "ref_logps": ref}
    core = loss.core
    if aggregation != "token_mean":
        core = type(core)(**{**vars(core), "aggregation": "token_mean"})
    terms = ppo_reference_terms(logps, torch.zeros_like(logps), fields, core) * mask
    if aggregation == "token_mean":
        return terms.sum() / mask.sum()
    if aggregation == "dr_grpo":
        return terms.sum() / (B * loss.max_completion_length)
    return (terms.sum(-1) / mask.sum(-1)).mean()


@pytest.mark.parametrize(
    "loss, aggregation",
    [
        (GRPOLoss(epsilon=0.2, beta=0.04), "seq_mean_token_mean"),
        (GRPOLoss(epsilon=0.1, epsilon_high=0.3), "seq_mean_token_mean"),
        (BNPOLoss(epsilon=0.2, beta=0.1), "token_mean"),
        (DRGRPOLoss(epsilon=0.2, beta=0.04, max_completion_length=7), "dr_grpo"),
        (PPOLoss(epsilon=0.2, beta=0.04), "token_mean"),
    ],
)
def test_value_and_gradient_equal_the_reference(loss, aggregation):
    logits, labels, logps, old, ref, adv = _batch()
    got = loss({"labels": labels}, {"logps": logps}, old_logps=old, ref_logps=ref, advantages=adv)
    want = _reference(loss, logps, labels, old, ref, adv, aggregation)
    assert got["num_tokens"] == 0
    torch.testing.assert_close(got["loss"], want, rtol=TOL, atol=TOL)
    (g_got,) = torch.autograd.grad(got["loss"], logits, retain_graph=True)
    (g_want,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(g_got, g_want, rtol=TOL, atol=TOL)
    assert g_want.abs().sum() > 0


def test_logits_give_the_same_loss_as_logps():
    logits, labels, logps, old, ref, adv = _batch()
    loss = GRPOLoss(beta=0.04)
    kw = dict(old_logps=old, ref_logps=ref, advantages=adv)
    a = loss({"labels": labels}, {"logps": logps}, **kw)["loss"]
    b = loss({"labels": labels}, {"logits": logits}, **kw)["loss"]
    torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)


def test_upstream_forms_of_per_sample_data_align_alike():
    """Per-token [B, T]; response-only lists (a sampler's log-probs); full rows longer than the
    batch (a forward_only output of a longer batch); per-sample lists, [B] and [B, 1]."""
    _, labels, logps, old, ref, adv = _batch()
    mask = labels != -100
    loss = GRPOLoss(beta=0.04)
    want = loss({"labels": labels}, {"logps": logps}, old_logps=old, ref_logps=ref, advantages=adv)
    response_only = [old[i][mask[i]].tolist() for i in range(B)]
    longer = torch.nn.functional.pad(ref, (0, 4), value=7.0)
    for advantages in (adv.tolist(), adv[:, None], adv[:, None].expand(B, T)):
        got = loss(
            {"labels": labels},
            {"logps": logps},
            old_logps=response_only,
            ref_logps=longer,
            advantages=advantages,
        )
        torch.testing.assert_close(got["loss"], want["loss"], rtol=TOL, atol=TOL)


def test_rows_without_supervised_tokens_count_in_the_mean_as_upstream():
    _, labels, logps, old, _, adv = _batch()
    labels = torch.cat([labels, torch.full((1, T), -100)])
    logps = torch.cat([logps, torch.zeros(1, T, dtype=torch.float64)])
    pad = torch.zeros(1, T, dtype=torch.float64)
    loss = GRPOLoss()
    got = loss(
        {"labels": labels},
        {"logps": logps},
        old_logps=torch.cat([old, pad]),
        advantages=[*adv.tolist(), 0.0],
    )["loss"]
    three = loss({"labels": labels[:B]}, {"logps": logps[:B]}, old_logps=old, advantages=adv)
    torch.testing.assert_close(got, three["loss"] * B / (B + 1), rtol=TOL, atol=TOL)


def test_misaligned_or_missing_data_is_refused():
    _, labels, logps, _, _, adv = _batch()
    loss = GRPOLoss()
    with pytest.raises(ValueError, match=r"advantages has 2 entries for 3 samples"):
        loss({"labels": labels}, {"logps": logps}, advantages=[1.0, 2.0])
    with pytest.raises(ValueError, match=r"old_logps\[0\] has 2 values.*4 supervised tokens"):
        loss({"labels": labels}, {"logps": logps}, old_logps=[[0.0, 0.0]] * B, advantages=adv)
    with pytest.raises(LossInputError, match="entropies"):
        GRPOLoss(entropy_coef=0.1)({"labels": labels}, {"logps": logps}, advantages=adv)
    with pytest.raises(ValueError, match="epsilon"):
        GRPOLoss(epsilon=1.5)
    with pytest.raises(ValueError, match="max_tokens"):
        DRGRPOLoss(max_completion_length=0)


def test_make_loss_resolves_names_classes_and_instances():
    assert isinstance(make_loss("GRPOLoss", epsilon=0.3, beta=0.04), GRPOLoss)
    assert make_loss("grpo").core.aggregation == "seq_mean_token_mean"
    assert make_loss(DRGRPOLoss, max_completion_length=8).core.aggregation == "dr_grpo"
    loss = BNPOLoss()
    assert make_loss(loss) is loss
    with pytest.raises(ValueError, match=r"GSPOLoss.*sequence-level"):
        make_loss("GSPOLoss")
    with pytest.raises(ValueError, match=r"CPOLoss.*behaviour-cloning"):
        make_loss("CPOLoss")
    with pytest.raises(ValueError, match="unknown loss 'nope'"):
        make_loss("nope")
