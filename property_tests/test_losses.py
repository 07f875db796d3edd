"""Properties of the token-sum losses, checked in float64 (rounding ~1e-16, tolerance 1e-9)."""

import itertools

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from twinkle_fn.losses import cross_entropy_sum, fused_linear_cross_entropy_sum

IGNORE = -100
EXACT = dict(rtol=1e-9, atol=1e-9)


@st.composite
def problems(draw):
    tokens = draw(st.integers(0, 40))
    hidden_size = draw(st.integers(1, 12))
    vocab = draw(st.integers(1, 40))
    ignore_fraction = draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    labels[torch.rand(tokens, generator=gen) < ignore_fraction] = IGNORE
    hidden = torch.randn(tokens, hidden_size, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, hidden_size, generator=gen, dtype=torch.float64)
    bias = torch.randn(vocab, generator=gen, dtype=torch.float64) if draw(st.booleans()) else None
    return hidden, weight, bias, labels


def _loss_and_grads(loss_fn, hidden, weight, bias, labels, needs, scale):
    inputs = [
        t.detach().requires_grad_(need)
        for t, need in zip((hidden, weight, bias), needs, strict=False)
        if t is not None
    ]
    bias_in = inputs[2] if bias is not None else None
    out = loss_fn(inputs[0], inputs[1], labels, bias_in)
    wanted = [t for t in inputs if t.requires_grad]
    grads = torch.autograd.grad(out.loss_sum * scale, wanted) if wanted else ()
    return out, grads


def _plain(hidden, weight, labels, bias):
    logits = hidden @ weight.T
    return cross_entropy_sum(logits if bias is None else logits + bias, labels)


@settings(max_examples=80, deadline=None)
@given(
    problem=problems(),
    chunk_size=st.integers(1, 50),
    needs=st.tuples(st.booleans(), st.booleans(), st.booleans()),
    scale=st.floats(-4, 4, allow_nan=False),
)
def test_fused_equals_plain(problem, chunk_size, needs, scale):
    hidden, weight, bias, labels = problem

    def fused(h, w, y, b):
        return fused_linear_cross_entropy_sum(h, w, y, bias=b, chunk_size=chunk_size)

    out, grads = _loss_and_grads(fused, hidden, weight, bias, labels, needs, scale)
    ref, ref_grads = _loss_and_grads(_plain, hidden, weight, bias, labels, needs, scale)
    torch.testing.assert_close(out.loss_sum, ref.loss_sum, **EXACT)
    assert out.num_tokens.item() == ref.num_tokens.item() == int((labels != IGNORE).sum())
    assert len(grads) == len(ref_grads)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, **EXACT)


@settings(max_examples=60, deadline=None)
@given(
    problem=problems(), cuts=st.lists(st.integers(0, 40), max_size=4), chunk_size=st.integers(1, 16)
)
def test_micro_batch_sums_equal_the_whole_batch(problem, cuts, chunk_size):
    hidden, weight, bias, labels = problem
    bounds = sorted({0, hidden.shape[0], *(min(c, hidden.shape[0]) for c in cuts)})
    parts = [
        fused_linear_cross_entropy_sum(
            hidden[a:b], weight, labels[a:b], bias=bias, chunk_size=chunk_size
        )
        for a, b in itertools.pairwise(bounds)
    ]
    whole = _plain(hidden, weight, labels, bias)
    loss_sum = sum((p.loss_sum for p in parts), torch.zeros((), dtype=torch.float64))
    torch.testing.assert_close(loss_sum, whole.loss_sum, **EXACT)
    assert sum(int(p.num_tokens) for p in parts) == int(whole.num_tokens)


@settings(max_examples=60, deadline=None)
@given(problem=problems())
def test_cross_entropy_sum_equals_torch(problem):
    hidden, weight, bias, labels = problem
    logits = hidden @ weight.T if bias is None else hidden @ weight.T + bias
    out = cross_entropy_sum(logits, labels)
    ref = F.cross_entropy(logits, labels, reduction="sum", ignore_index=IGNORE)
    torch.testing.assert_close(out.loss_sum, ref, **EXACT)
    assert int(out.num_tokens) == int((labels != IGNORE).sum())
