import pytest
import torch
import torch.nn.functional as F

from twinkle_fn.losses import LossOutput, cross_entropy_sum, token_logps

IGNORE = -100


def _batch(shape=(3, 11), vocab=17, dtype=torch.float32, ignore_fraction=0.3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(*shape, vocab, generator=gen, dtype=torch.float64)).to(dtype)
    labels = torch.randint(0, vocab, shape, generator=gen)
    labels[torch.rand(shape, generator=gen) < ignore_fraction] = IGNORE
    return logits.requires_grad_(), labels


# Both sides upcast to float32 and differ only in summation order: a few float32 ulps of a sum
# of ~30 terms of size ~5. float64 inputs stay float64 on both sides.
TOLERANCE = {
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.float32: dict(rtol=1e-6, atol=1e-5),
    torch.bfloat16: dict(rtol=1e-6, atol=1e-5),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_cross_entropy_sum_matches_torch_value_and_grad(dtype):
    logits, labels = _batch(dtype=dtype)
    out = cross_entropy_sum(logits, labels)
    ref_logits = logits.detach().to(torch.promote_types(dtype, torch.float32)).requires_grad_()
    vocab = logits.shape[-1]
    ref = F.cross_entropy(
        ref_logits.view(-1, vocab), labels.view(-1), reduction="sum", ignore_index=IGNORE
    )
    assert isinstance(out, LossOutput)
    assert out.loss_sum.shape == () and out.loss_sum.dtype == ref.dtype
    assert out.num_tokens.dtype == torch.int64 and out.num_tokens.shape == ()
    assert out.num_tokens.item() == (labels != IGNORE).sum().item() > 0
    torch.testing.assert_close(out.loss_sum, ref, **TOLERANCE[dtype])

    (grad,) = torch.autograd.grad(out.loss_sum * 3, logits)
    (ref_grad,) = torch.autograd.grad(ref * 3, ref_logits)
    assert grad.dtype == dtype
    torch.testing.assert_close(grad, ref_grad.to(dtype))


def test_token_logps_matches_log_softmax_gather():
    logits, labels = _batch(shape=(2, 4, 5), dtype=torch.float64)
    logps = token_logps(logits, labels)
    expected = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    supervised = labels != IGNORE
    assert logps.shape == labels.shape
    torch.testing.assert_close(logps[supervised], expected[supervised], rtol=1e-12, atol=1e-12)
    assert torch.all(logps[~supervised] == 0)


def test_token_logps_upcasts_bfloat16():
    logits, labels = _batch(dtype=torch.bfloat16, ignore_fraction=0.0)
    logps = token_logps(logits, labels)
    assert logps.dtype == torch.float32
    expected = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None])[..., 0]
    torch.testing.assert_close(logps, expected)


def test_custom_ignore_index_and_int32_labels():
    logits, labels = _batch(ignore_fraction=0.0)
    labels = labels.to(torch.int32)
    labels[0, :4] = 0
    out = cross_entropy_sum(logits, labels, ignore_index=0)
    ref = F.cross_entropy(
        logits.view(-1, 17), labels.view(-1).long(), reduction="sum", ignore_index=0
    )
    torch.testing.assert_close(out.loss_sum, ref)
    assert out.num_tokens.item() == (labels != 0).sum().item()


def test_all_ignored_gives_zero_loss_count_and_grad():
    logits, labels = _batch(ignore_fraction=1.0)
    out = cross_entropy_sum(logits, labels)
    (grad,) = torch.autograd.grad(out.loss_sum, logits)
    assert out.loss_sum.item() == 0 and out.num_tokens.item() == 0
    assert torch.all(grad == 0)


def test_micro_batch_sums_give_the_full_batch_mean():
    logits, labels = _batch(shape=(8, 9), dtype=torch.float64, ignore_fraction=0.5, seed=3)
    parts = [
        cross_entropy_sum(lg, lb) for lg, lb in zip(logits.split(3), labels.split(3), strict=True)
    ]
    mean = sum(p.loss_sum for p in parts) / sum(p.num_tokens for p in parts)
    ref = F.cross_entropy(logits.view(-1, 17), labels.view(-1), ignore_index=IGNORE)
    torch.testing.assert_close(mean, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        (torch.zeros(3, 11), "integer"),
        (torch.zeros(3, 11, dtype=torch.bool), "integer"),
        (torch.zeros(3, 10, dtype=torch.long), "shape"),
        (torch.full((3, 11), 17), r"labels\[0, 0\] = 17 is outside"),
        (torch.full((3, 11), -1), r"labels\[0, 0\] = -1 is outside"),
    ],
)
def test_bad_labels_raise(labels, message):
    logits, _ = _batch()
    with pytest.raises(ValueError, match=message):
        cross_entropy_sum(logits, labels)


def test_bad_logits_raise():
    with pytest.raises(ValueError, match="floating point"):
        token_logps(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="vocab > 0"):
        token_logps(torch.zeros(2, 0), torch.zeros(2, dtype=torch.long))
