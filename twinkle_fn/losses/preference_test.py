"""DPO and SimPO by exact linearisation: the linear token loss built from one pass's
log-probabilities has the preference loss's value and gradient (against a float64 reference
written with ``log(sigmoid(.))``), in padded and packed layouts; any split of its fields sums
to the whole; bad batches and arguments are refused before any compute.

Tolerances: float64 end to end, the same sums in another order (1e-12).
"""

import pytest
import torch

from twinkle_fn.data import pack, pad_collate
from twinkle_fn.losses import (
    LinearisedPairs,
    PreferenceLoss,
    TokenInputs,
    check_loss,
    dpo_loss,
    is_sequence_loss,
    sequence_index,
    simpo_loss,
)
from twinkle_fn.testing import preference_reference_losses, random_features

EXACT = dict(rtol=1e-12, atol=1e-12)
LOSSES = {
    "dpo": dpo_loss(0.5),
    "dpo-smoothed": dpo_loss(0.5, label_smoothing=0.1),
    "dpo-sequence-reference": dpo_loss(0.5, reference="sequences"),
    "simpo": simpo_loss(2.5, 0.5),
}


def _features(n=6, seed=0):
    """`n` features with float64 per-token log-probs ``lp`` (0 where unsupervised), per-token
    ``ref_logps`` and per-sample ``ref_seq_logps`` (the sum of the former, rounded to float32,
    collation's dtype for a number). Margins of a few nats: the sigmoids are not saturated."""
    gen = torch.Generator().manual_seed(seed)
    feats = random_features(n, seed=seed)
    for f in feats:
        supervised = torch.tensor(f["labels"]) != -100
        lp = -3 * torch.rand(len(f["labels"]), generator=gen, dtype=torch.float64)
        ref = -3 * torch.rand(len(f["labels"]), generator=gen, dtype=torch.float64)
        f["lp"] = torch.where(supervised, lp, 0.0)
        f["ref_logps"] = torch.where(supervised, ref, 0.0)
        f["ref_seq_logps"] = float(f["ref_logps"].sum().float())
    return feats


def _batch(feats, layout):
    return pack(feats) if layout == "packed" else pad_collate(feats, pad_token_id=0)


def _reference(feats, loss):
    """Pair losses ``[P]`` and their gradient w.r.t. each feature's ``lp``."""
    lps = [f["lp"].clone().requires_grad_() for f in feats]
    masks = [torch.tensor(f["labels"]) != -100 for f in feats]
    sums = torch.stack([torch.where(m, lp, 0.0).sum() for lp, m in zip(lps, masks, strict=True)])
    lengths = torch.tensor([sum(x != -100 for x in f["labels"]) for f in feats]).double()
    if loss.reference == "sequences":
        ref = torch.tensor([f["ref_seq_logps"] for f in feats], dtype=torch.float64)
    else:
        ref = torch.stack([f["ref_logps"].sum() for f in feats])
    losses = preference_reference_losses(sums, lengths, ref, loss)
    return losses.detach(), torch.autograd.grad(losses.sum(), lps)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_the_linearised_loss_has_the_preference_losss_value_and_gradient(name, layout):
    loss, feats = LOSSES[name], _features()
    batch = _batch(feats, layout)
    logps = batch["lp"].clone().requires_grad_()  # [B, T], the first pass's
    linear, fed = loss.linearise(batch, logps.detach())
    assert isinstance(linear, LinearisedPairs) and set(linear.fields) <= fed.keys()
    out = linear(TokenInputs(logps, fed["labels"], {k: fed[k] for k in linear.fields}))
    (grad,) = torch.autograd.grad(out.loss_sum, logps)
    want_losses, want_grads = _reference(feats, loss)
    torch.testing.assert_close(out.loss_sum, want_losses.sum(), **EXACT)
    assert out.num_tokens.dtype == torch.int64 and int(out.num_tokens) == len(feats) // 2
    # the batch's layout of each feature's gradient
    want = _batch([{**f, "lp": g} for f, g in zip(feats, want_grads, strict=True)], layout)["lp"]
    torch.testing.assert_close(grad, want, **EXACT)
    assert (grad[batch["labels"] == -100] == 0).all()


def test_any_split_of_the_linearised_fields_sums_to_the_whole():
    """Rows [0:3] and [3:6] cut the second pair in two: each part's terms are per token, so the
    parts' sums and counts add up to the whole's (the pair counted once, on its chosen row)."""
    loss, feats = LOSSES["dpo"], _features()
    batch = _batch(feats, "padded")
    linear, fed = loss.linearise(batch, batch["lp"])

    def run(rows):
        fields = {k: fed[k][rows] for k in linear.fields}
        return linear(TokenInputs(fed["lp"][rows], fed["labels"][rows], fields))

    whole, parts = run(slice(0, 6)), [run(slice(0, 3)), run(slice(3, 6))]
    assert [int(p.num_tokens) for p in parts] == [2, 1]
    torch.testing.assert_close(sum(p.loss_sum for p in parts), whole.loss_sum, **EXACT)


def test_sequences_are_rows_or_packed_samples():
    feats = _features(4)
    padded, count = sequence_index(_batch(feats, "padded"))
    assert count == 4 and (padded == torch.arange(4)[:, None]).all()
    packed, count = sequence_index(_batch(feats, "packed"))
    lengths = [len(f["input_ids"]) for f in feats]
    assert count == 4 and packed[0].tolist() == [i for i, n in enumerate(lengths) for _ in range(n)]


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_an_odd_number_of_sequences_is_refused_naming_the_layout(layout):
    what = "5 packed samples" if layout == "packed" else "5 rows"
    with pytest.raises(ValueError, match=f"{what}, an odd number.*interleaved.*whole pairs"):
        check_loss(LOSSES["dpo"], _batch(_features(5), layout))


def test_a_missing_reference_is_refused_naming_the_field_and_the_fix():
    feats = [{k: v for k, v in f.items() if not k.startswith("ref")} for f in _features()]
    batch = _batch(feats, "padded")
    with pytest.raises(ValueError, match=r"'ref_logps', which is missing.*tf.token_logps"):
        check_loss(dpo_loss(), batch)
    with pytest.raises(ValueError, match="'ref_seq_logps', which is missing"):
        check_loss(dpo_loss(reference="sequences"), batch)
    check_loss(simpo_loss(), batch)  # no reference


def test_a_sequence_without_supervised_tokens_is_refused():
    feats = _features(4)
    feats[3] = {**feats[3], "labels": [-100] * len(feats[3]["labels"])}
    with pytest.raises(ValueError, match=r"sequence 3 .* no supervised token"):
        check_loss(simpo_loss(), _batch(feats, "packed"))


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: dpo_loss(0.0), "beta must be a finite number > 0"),
        (lambda: dpo_loss(float("nan")), "beta must be a finite number > 0"),
        (lambda: dpo_loss(label_smoothing=0.5), r"label_smoothing must be in \[0, 0.5\)"),
        (lambda: dpo_loss(reference="logits"), "reference must be one of"),
        (lambda: simpo_loss(gamma=-1.0), "gamma must be a finite number >= 0"),
        (lambda: simpo_loss(beta=True), "beta must be a finite number > 0"),
    ],
)
def test_bad_arguments_are_refused(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_a_preference_loss_is_a_sequence_loss_with_its_reference_field():
    assert is_sequence_loss(dpo_loss()) and not is_sequence_loss(LinearisedPairs())
    assert dpo_loss().fields == ("ref_logps",)
    assert dpo_loss(reference="sequences").fields == ("ref_seq_logps",)
    assert simpo_loss().fields == () and isinstance(simpo_loss(), PreferenceLoss)
