"""`fused_linear_token_logps` against the unfused float64 reference: values and gradients."""

import pytest
import torch

from twinkle_fn.losses import token_entropy, token_logps
from twinkle_fn.losses.fused_linear_logps import fused_linear_token_logps


def _inputs(dtype, *, bias=True, seed=0, tokens=(3, 7), hidden=16, vocab=50):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(*tokens, hidden, generator=gen, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) / hidden**0.5
    b = torch.randn(vocab, generator=gen, dtype=torch.float64) if bias else None
    labels = torch.randint(0, vocab, tokens, generator=gen)
    labels[0, :2] = -100
    labels[2, -1] = -100
    g = torch.randn(tokens, generator=gen, dtype=torch.float64)
    e = torch.randn(tokens, generator=gen, dtype=torch.float64)
    leaves = [x.to(dtype).requires_grad_() for x in (h, w) + ((b,) if bias else ())]
    return leaves, labels, g, e


def _objective(terms_of, leaves, labels, g, e, entropy):
    logps, ent = terms_of(leaves, labels)
    value = (logps * g).sum() + ((ent * e).sum() if entropy else 0.0)
    grads = torch.autograd.grad(value, leaves)
    return logps.detach(), None if ent is None else ent.detach(), grads


def _reference(temperature, entropy):
    def terms(leaves, labels):
        h, w, *b = leaves
        logits = (h @ w.t() + (b[0] if b else 0.0)) / temperature
        return token_logps(logits, labels), token_entropy(logits, labels) if entropy else None

    return terms


def _fused(temperature, entropy, chunk_size):
    def terms(leaves, labels):
        h, w, *b = leaves
        out = fused_linear_token_logps(
            h,
            w,
            labels,
            bias=b[0] if b else None,
            temperature=temperature,
            with_entropy=entropy,
            chunk_size=chunk_size,
        )
        return out.logps, out.entropy

    return terms


@pytest.mark.parametrize("chunk_size", [1, 4, 64])
@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
def test_float64_equals_the_unfused_terms_in_value_and_gradient(
    chunk_size, entropy, temperature, bias
):
    """float64 throughout: only summation order differs, so 1e-12."""
    leaves, labels, g, e = _inputs(torch.float64, bias=bias)
    want = _objective(_reference(temperature, entropy), leaves, labels, g, e, entropy)
    got = _objective(_fused(temperature, entropy, chunk_size), leaves, labels, g, e, entropy)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-12)
    if entropy:
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-12)
    for a, b in zip(got[2], want[2], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert (got[0][labels == -100] == 0).all()


def test_bfloat16_matches_float32_math_on_bfloat16_inputs():
    """bf16 inputs: the matmuls round to bf16 (8 bits of mantissa, ~4e-3 relative), the softmax
    runs in float32; against the float64 reference of the same bf16 numbers, 3e-2 absolute on
    log-probs of magnitude ~4 and on gradients of magnitude ~1."""
    leaves, labels, g, e = _inputs(torch.bfloat16)
    want = _objective(
        _reference(1.0, True),
        [x.detach().double().requires_grad_() for x in leaves],
        labels,
        g,
        e,
        True,
    )
    got = _objective(_fused(1.0, True, 8), leaves, labels, g.bfloat16(), e.bfloat16(), True)
    assert got[0].dtype == torch.float32
    torch.testing.assert_close(got[0].double(), want[0], rtol=0, atol=3e-2)
    torch.testing.assert_close(got[1].double(), want[1], rtol=0, atol=3e-2)
    for a, b in zip(got[2], want[2], strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.double(), b, rtol=0, atol=3e-2)


def test_an_unsupervised_batch_gives_zeros_and_zero_gradients():
    leaves, labels, g, e = _inputs(torch.float32)
    labels = torch.full_like(labels, -100)
    logps, ent, grads = _objective(_fused(1.0, True, 4), leaves, labels, g.float(), e.float(), True)
    assert (logps == 0).all() and (ent == 0).all()
    assert all((grad == 0).all() for grad in grads)


def test_a_frozen_head_gets_no_gradient_and_the_trunk_still_does():
    (h, w, b), labels, g, _ = _inputs(torch.float64)
    w.requires_grad_(False)
    b.requires_grad_(False)
    out = fused_linear_token_logps(h, w, labels, bias=b, chunk_size=4)
    (grad,) = torch.autograd.grad((out.logps * g).sum(), [h])
    want = torch.autograd.grad((token_logps(h @ w.t() + b, labels) * g).sum(), [h])[0]
    torch.testing.assert_close(grad, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("temperature", [0, -1.0, True])
def test_a_bad_temperature_is_named(temperature):
    (h, w, _), labels, _, _ = _inputs(torch.float32)
    with pytest.raises(
        ValueError, match=f"temperature must be a positive number, got {temperature!r}"
    ):
        fused_linear_token_logps(h, w, labels, temperature=temperature)


def test_a_label_outside_the_vocabulary_is_named():
    (h, w, _), labels, _, _ = _inputs(torch.float32)
    labels[1, 1] = 50
    with pytest.raises(ValueError, match="50"):
        fused_linear_token_logps(h, w, labels)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("entropy", [False, True])
def test_bfloat16_on_cuda_matches_the_float64_reference(entropy):
    """Log-probs alone run in the Triton kernel, the entropy in torch ops. The same bound as on
    the CPU for the terms (3e-2); gradients summed over 1200 tokens grow to ~30, and each
    carries bf16's relative rounding (~4e-3) once: 1e-2 relative."""
    leaves, labels, g, e = _inputs(torch.bfloat16, tokens=(4, 300), hidden=64, vocab=1000)
    cuda = [x.detach().cuda().requires_grad_() for x in leaves]
    ref = [x.detach().double().requires_grad_() for x in leaves]
    want = _objective(_reference(1.0, entropy), ref, labels, g, e, entropy)
    got = _objective(_fused(1.0, entropy, 256), cuda, labels.cuda(), g.cuda(), e.cuda(), entropy)
    torch.testing.assert_close(got[0].cpu().double(), want[0], rtol=0, atol=3e-2)
    if entropy:
        torch.testing.assert_close(got[1].cpu().double(), want[1], rtol=0, atol=3e-2)
    for a, b in zip(got[2], want[2], strict=True):
        torch.testing.assert_close(a.cpu().double(), b, rtol=1e-2, atol=3e-2)
