"""`DPOLoss` / `SimPOLoss` called as upstream's equal hand-written float64 references.

Float32 log-probs of random logits; the references recompute the pair losses from the same
numbers in float64. Values agree to 1e-6 relative and gradients (w.r.t. the logits) to 1e-6
absolute: the classes sum float32 log-probs in float64 and weigh them with float64 pair
derivatives rounded once to float32 (gradients here are ~1e-2).
"""

import pytest
import torch
import torch.nn.functional as F

from twinkle.loss import DPOLoss, LossInputError, SimPOLoss, make_loss

B, T, V = 6, 7, 11


def _batch():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(B, T, V, generator=gen, dtype=torch.float32).requires_grad_()
    labels = torch.randint(0, V, (B, T), generator=gen)
    labels[:, :2] = -100  # prompts
    labels[1, 5:] = -100  # a shorter rejected response
    ref = torch.randn(B, T, generator=gen).clamp(max=0) - 1.0
    return logits, labels, ref


def _sums(logits, labels):
    """Per-row float64 sums of log p(label) over supervised tokens, and their counts."""
    logps = F.log_softmax(logits.double(), -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    mask = labels != -100
    return torch.where(mask, logps, 0.0).sum(-1), mask.sum(-1).double()


def _check(got, want, logits):
    assert got["num_tokens"] == 0 and got["loss"].dim() == 0
    assert float(got["loss"].detach()) == pytest.approx(float(want), rel=1e-6)
    g_got = torch.autograd.grad(got["loss"], logits, retain_graph=True)
    (g_want,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(g_got[0], g_want.float(), rtol=0, atol=1e-6)
    assert g_want.abs().max() > 1e-3


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("ref_form", ["tokens", "sequences", "outputs", "free"])
def test_dpo_equals_the_float64_reference(smoothing, ref_form):
    logits, labels, ref = _batch()
    s, _ = _sums(logits, labels)
    r = torch.where(labels != -100, ref.double(), 0.0).sum(-1)
    if ref_form == "free":
        r = torch.zeros_like(r)
    z = 0.3 * ((s[0::2] - r[0::2]) - (s[1::2] - r[1::2]))
    want = (-(1 - smoothing) * F.logsigmoid(z) - smoothing * F.logsigmoid(-z)).mean()
    loss = DPOLoss(beta=0.3, label_smoothing=smoothing, reference_free=ref_form == "free")
    kw = {
        "tokens": dict(ref_logps=torch.cat([ref, torch.zeros(B, 3)], 1)),  # longer rows
        "sequences": dict(ref_chosen_logps=r[0::2].float(), ref_rejected_logps=r[1::2].float()),
        "outputs": dict(ref_outputs={"logps": ref}),
        "free": {},
    }[ref_form]
    _check(loss({"labels": labels}, {"logits": logits}, **kw), want, logits)


def test_simpo_equals_the_float64_reference():
    logits, labels, _ = _batch()
    s, n = _sums(logits, labels)
    avg = s / n
    want = -F.logsigmoid(2.0 * (avg[0::2] - avg[1::2]) - 0.4).mean()
    _check(SimPOLoss(beta=2.0, gamma=0.4)({"labels": labels}, {"logits": logits}), want, logits)


def test_set_loss_names_build_the_core_losses():
    dpo = make_loss("DPOLoss", beta=0.1)
    assert (dpo.core.kind, dpo.core.beta, dpo.core.reference) == ("dpo", 0.1, "tokens")
    assert dpo.required_inputs() == ("ref_logps",)
    assert make_loss("dpo", reference_free=True).core.reference == "sequences"
    simpo = make_loss("simpo", beta=2.0, gamma=0.3)
    assert (simpo.core.kind, simpo.core.beta, simpo.core.gamma) == ("simpo", 2.0, 0.3)


def test_model_data_maps_ref_outputs_and_the_reference_free_zeros():
    ref = [[-1.0, -2.0]]
    assert DPOLoss().model_data({"ref_outputs": {"logps": ref}}, 1) == {"ref_logps": ref}
    assert DPOLoss(reference_free=True).model_data({}, 2) == {"ref_seq_logps": [0.0, 0.0]}
    with pytest.raises(ValueError, match="reads no reference; drop"):
        DPOLoss(reference_free=True).model_data({"ref_logps": ref}, 1)
    with pytest.raises(ValueError, match="ref_outputs must be a forward_only output"):
        DPOLoss().model_data({"ref_outputs": [1.0]}, 1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(loss_type="hinge"), r"loss_type='hinge'\) is not available.*sigmoid"),
        (dict(loss_type="nope"), "Unknown loss_type: nope"),
        (dict(sft_weight=0.1), r"sft_weight=0\.1\) is not available"),
        (dict(beta=0.0), "beta must be a finite number > 0"),
        (dict(label_smoothing=0.5), r"label_smoothing must be in \[0, 0\.5\)"),
    ],
)
def test_dpo_refuses_what_the_core_lacks(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DPOLoss(**kwargs)


def test_called_losses_refuse_bad_batches_as_upstream():
    logits, labels, ref = _batch()
    with pytest.raises(AssertionError, match="even"):
        DPOLoss()({"labels": labels[:3]}, {"logits": logits[:3]}, ref_logps=ref[:3])
    labels[2] = -100
    with pytest.raises(LossInputError, match=r"sequence 2 .* no supervised token"):
        SimPOLoss()({"labels": labels}, {"logits": logits})
