"""`fused_linear_cross_entropy_sum` on the CPU: loss and gradients equal the plain
``hidden @ weight.T`` cross entropy in every dtype and chunking, per-token losses, the matmuls
it skips and the logits it never materialises, and the arguments it refuses. The CUDA paths
(memory budget, the Triton kernel, no host sync) are in ``fused_linear_ce_cuda_test.py``."""

import math
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from twinkle_fn.losses import (
    LossOutput,
    cross_entropy_sum,
    fused_linear_cross_entropy_sum,
)
from twinkle_fn.losses.fused_linear_ce import TokenLossOutput, supervised_rows
from twinkle_fn.pytree import tree_leaves

IGNORE = -100


def _problem(
    lead=(3, 16), hidden=8, vocab=24, dtype=torch.float64, ignore_fraction=0.25, bias=True, seed=0
):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()

    labels = torch.randint(0, vocab, lead, generator=gen)
    labels[torch.rand(lead, generator=gen) < ignore_fraction] = IGNORE
    return randn(*lead, hidden), randn(vocab, hidden), randn(vocab) if bias else None, labels


def _plain(hidden, weight, labels, bias=None):
    logits = hidden @ weight.T
    return cross_entropy_sum(logits if bias is None else logits + bias, labels)


def _run(loss_fn, hidden, weight, labels, bias=None, scale=3.0, **kwargs):
    """Loss, count and the gradients of ``scale * loss_sum`` w.r.t. the inputs that need them."""
    out = loss_fn(hidden, weight, labels, bias=bias, **kwargs)
    inputs = [t for t in (hidden, weight, bias) if t is not None and t.requires_grad]
    grads = torch.autograd.grad(out.loss_sum * scale, inputs) if inputs else ()
    return out, grads


def _fused(hidden, weight, labels, bias=None, **kwargs):
    return fused_linear_cross_entropy_sum(hidden, weight, labels, bias=bias, **kwargs)


def _assert_matches_plain(hidden, weight, labels, bias, chunk_size, **tolerance):
    out, grads = _run(_fused, hidden, weight, labels, bias, chunk_size=chunk_size)
    ref, ref_grads = _run(_plain, hidden, weight, labels, bias)
    torch.testing.assert_close(out.loss_sum, ref.loss_sum, **tolerance)
    assert out.num_tokens.dtype == torch.int64 and out.num_tokens.item() == ref.num_tokens.item()
    assert len(grads) == len(ref_grads)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        assert grad.dtype == ref_grad.dtype and grad.shape == ref_grad.shape
        torch.testing.assert_close(grad, ref_grad, **tolerance)


# 48 tokens, ~36 supervised: chunks of 1, ones that leave a remainder, one bigger than the batch.
CHUNKS = [1, 5, 7, 16, 1000]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_float64_matches_plain(chunk_size, bias):
    # float64 rounding is ~1e-16 per op; only summation order differs from the plain path.
    hidden, weight, bias_t, labels = _problem(bias=bias)
    _assert_matches_plain(hidden, weight, labels, bias_t, chunk_size, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_float32_matches_plain(chunk_size):
    # float32 eps is 1.2e-7; the chunked path sums the loss and the weight gradient in another
    # order and normalises the softmax by hand, so results agree to a few ulps of sums of
    # ~40 terms of size ~1-10, well inside 1e-5.
    hidden, weight, bias, labels = _problem(dtype=torch.float32)
    _assert_matches_plain(hidden, weight, labels, bias, chunk_size, rtol=1e-5, atol=1e-5)


def _relative_error(value, reference):
    return ((value.double() - reference).norm() / reference.norm()).item()


def _assert_as_accurate_as_plain(hidden, weight, bias, labels, chunk_size, floor):
    """Fused and plain errors w.r.t. a float64 computation on the same (rounded) inputs.

    The fused result may be at most twice as far from float64 as the plain one, plus `floor`:
    a direct fused-vs-plain comparison in bf16 would mostly measure the rounding of both.
    """
    exact = [t.detach().double().requires_grad_() for t in (hidden, weight, bias)]
    ref, ref_grads = _run(_plain, exact[0], exact[1], labels, exact[2])
    out, grads = _run(_fused, hidden, weight, labels, bias, chunk_size=chunk_size)
    plain, plain_grads = _run(_plain, hidden, weight, labels, bias)
    assert out.loss_sum.dtype == plain.loss_sum.dtype == torch.float32
    assert [g.dtype for g in grads] == [hidden.dtype] * 3
    assert out.num_tokens.item() == ref.num_tokens.item()
    pairs = [(out.loss_sum, plain.loss_sum, ref.loss_sum)]
    for values in zip(grads, plain_grads, ref_grads, strict=True):
        pairs.append(values)
    for fused_value, plain_value, ref_value in pairs:
        fused_error = _relative_error(fused_value, ref_value)
        assert fused_error <= 2 * _relative_error(plain_value, ref_value) + floor


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_is_as_accurate_as_the_plain_path(dtype):
    # bf16 keeps 8 mantissa bits (relative rounding 4e-3), fp16 11: logits and gradients are
    # rounded to them on both paths, so a few 1e-3 of relative error is expected of either.
    hidden, weight, bias, labels = _problem(dtype=dtype, hidden=16, vocab=64)
    _assert_as_accurate_as_plain(hidden, weight, bias, labels, chunk_size=7, floor=4e-3)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 7, 1000])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_token_losses_equal_unreduced_cross_entropy(dtype, tolerance, chunk_size, bias):
    hidden, weight, bias_t, labels = _problem(dtype=dtype, bias=bias)
    out = _fused(hidden, weight, labels, bias_t, chunk_size=chunk_size, return_token_losses=True)
    assert isinstance(out, TokenLossOutput)
    logits = hidden @ weight.T + (0 if bias_t is None else bias_t)  # [3, 16, vocab]
    expected = torch.nn.functional.cross_entropy(
        logits.permute(0, 2, 1), labels, ignore_index=IGNORE, reduction="none"
    )
    assert out.token_losses.shape == labels.shape and out.token_losses.dtype == dtype
    assert not out.token_losses.requires_grad
    torch.testing.assert_close(out.token_losses, expected.detach(), rtol=tolerance, atol=tolerance)
    ignored = labels == IGNORE
    assert ignored.any() and torch.all(out.token_losses[ignored] == 0)
    assert torch.all(out.token_losses[~ignored] > 0)
    torch.testing.assert_close(out.token_losses.sum(), out.loss_sum.detach())


def test_token_losses_leave_loss_and_gradients_unchanged():
    hidden, weight, bias, labels = _problem(dtype=torch.float32)
    plain, grads = _run(_fused, hidden, weight, labels, bias, chunk_size=7)
    with_tokens, token_grads = _run(
        _fused, hidden, weight, labels, bias, chunk_size=7, return_token_losses=True
    )
    assert type(plain) is LossOutput and type(with_tokens) is TokenLossOutput
    assert torch.equal(plain.loss_sum, with_tokens.loss_sum)
    assert torch.equal(plain.num_tokens, with_tokens.num_tokens)
    for grad, token_grad in zip(grads, token_grads, strict=True):
        assert torch.equal(grad, token_grad)


def test_token_losses_of_an_ignored_batch_are_zero():
    hidden, weight, bias, labels = _problem(ignore_fraction=1.0)
    out = _fused(hidden, weight, labels, bias, return_token_losses=True)
    assert out.token_losses.shape == labels.shape and torch.all(out.token_losses == 0)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])]


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_grad_is_scaled_in_float32(device):
    # grad_output is typically 1 / num_tokens, which bf16 cannot hold exactly: the stored
    # gradient must be scaled in float32 and rounded to bf16 once. (On CPU torch already reads
    # a 0-d float32 factor at full precision; on CUDA it would round it to bf16 first.)
    hidden, weight, _, labels = (t.detach().to(device) for t in _problem(dtype=torch.bfloat16))
    hidden.requires_grad_()
    scale = 1 / 3000
    _, (unscaled,) = _run(_fused, hidden, weight, labels, scale=1.0)
    _, (scaled,) = _run(_fused, hidden, weight, labels, scale=scale)
    expected = (unscaled.float() * scale).to(torch.bfloat16)
    assert torch.equal(scaled, expected)
    assert not torch.equal(expected, unscaled * torch.tensor(scale, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    "needs", [(True, False, False), (False, True, True), (False, False, False)]
)
def test_only_requested_gradients(needs):
    hidden, weight, bias, labels = _problem()
    for tensor, need in zip((hidden, weight, bias), needs, strict=True):
        tensor.requires_grad_(need)
    _assert_matches_plain(hidden, weight, labels, bias, chunk_size=5, rtol=1e-10, atol=1e-10)


class _Recorder(TorchDispatchMode):
    """Counts every aten op and records the largest tensor any op returns."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops[func.overloadpacket.__name__] += 1
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.max_numel = max(self.max_numel, leaf.numel())
        return out


def _matmuls(needs, chunk_size=8, ignore_fraction=0.0):
    """(matmul count, supervised token count) of one forward + backward."""
    hidden, weight, _, labels = _problem(lead=(32,), bias=False, ignore_fraction=ignore_fraction)
    hidden.requires_grad_(needs[0])
    weight.requires_grad_(needs[1])
    with _Recorder() as recorder:
        _run(_fused, hidden, weight, labels, chunk_size=chunk_size)
    count = sum(recorder.ops[name] for name in ("mm", "addmm", "addmm_"))
    return count, int((labels != IGNORE).sum())


def test_frozen_inputs_skip_their_matmuls():
    # 32 tokens in 4 chunks: one matmul per chunk for the logits, one per gradient needed.
    assert _matmuls((True, True)) == (4 * 3, 32)
    assert _matmuls((True, False)) == (4 * 2, 32)
    assert _matmuls((False, True)) == (4 * 2, 32)
    assert _matmuls((False, False)) == (4 * 1, 32)


def test_ignored_tokens_are_never_projected():
    assert _matmuls((True, True), ignore_fraction=1.0) == (0, 0)
    # chunks are filled with supervised tokens only: ceil(supervised / 8) chunks, not 4
    count, supervised = _matmuls((True, True), ignore_fraction=0.5)
    assert 0 < supervised <= 24 and count == 3 * math.ceil(supervised / 8)


def test_all_ignored_gives_zero_loss_count_and_grads():
    hidden, weight, bias, labels = _problem(dtype=torch.float32, ignore_fraction=1.0)
    out, grads = _run(_fused, hidden, weight, labels, bias, chunk_size=4)
    assert out.loss_sum.item() == 0 and out.num_tokens.item() == 0
    for grad in grads:
        assert torch.all(grad == 0)


def test_no_tokens_at_all():
    hidden, weight, bias, labels = _problem(lead=(0,))
    out, grads = _run(_fused, hidden, weight, labels, bias)
    assert out.loss_sum.item() == 0 and out.num_tokens.item() == 0
    assert grads[0].shape == (0, 8) and torch.all(grads[1] == 0)


def test_tied_embeddings_get_both_gradients():
    gen = torch.Generator().manual_seed(1)
    embed = torch.nn.Embedding(24, 8, dtype=torch.float64)
    mix = torch.nn.Linear(8, 8, dtype=torch.float64)
    ids = torch.randint(0, 24, (2, 10), generator=gen)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), IGNORE)], dim=1)  # shifted next-token

    def embed_grad(loss_fn):
        embed.weight.grad = None
        hidden = torch.tanh(mix(embed(ids)))
        out = loss_fn(hidden, embed.weight, labels, chunk_size=3)
        out.loss_sum.backward()
        return embed.weight.grad.clone()

    fused = embed_grad(fused_linear_cross_entropy_sum)
    plain = embed_grad(lambda h, w, y, chunk_size: cross_entropy_sum(h @ w.T, y))
    torch.testing.assert_close(fused, plain, rtol=1e-10, atol=1e-10)
    # the head alone would give a different gradient: the embedding path really contributed
    hidden = torch.tanh(mix(embed(ids))).detach()
    (head_only,) = torch.autograd.grad(_fused(hidden, embed.weight, labels).loss_sum, embed.weight)
    assert not torch.allclose(fused, head_only)


def test_backward_twice_with_retained_graph():
    hidden, weight, bias, labels = _problem()
    loss = _fused(hidden, weight, labels, bias, chunk_size=5).loss_sum
    first = torch.autograd.grad(loss * 2, (hidden, weight, bias), retain_graph=True)
    second = torch.autograd.grad(loss * 2, (hidden, weight, bias))
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_never_materialises_full_logits():
    tokens, vocab, hidden_size, chunk = 512, 1024, 32, 64
    hidden, weight, bias, labels = _problem(
        lead=(4, tokens // 4), hidden=hidden_size, vocab=vocab, dtype=torch.float32
    )
    full = tokens * vocab
    saved = []

    def run(loss_fn, **kwargs):
        saved.clear()
        with (
            torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append(t.numel()) or t, lambda t: t
            ),
            _Recorder() as recorder,
        ):
            _run(loss_fn, hidden, weight, labels, bias, **kwargs)
        return recorder.max_numel

    # The recorder does see a full logits tensor when one exists...
    assert run(_plain) >= full
    # ...and the fused loss creates nothing bigger than a chunk of logits or the weight.
    largest = run(_fused, chunk_size=chunk)
    assert largest <= max(chunk * vocab, vocab * hidden_size, tokens * hidden_size)
    assert largest < full
    assert saved and max(saved) < full


def test_leading_dims_are_flattened():
    hidden, weight, bias, labels = _problem(lead=(2, 3, 5))
    nested = _fused(hidden, weight, labels, bias, chunk_size=4).loss_sum
    flat = _fused(hidden.reshape(30, 8), weight, labels.reshape(30), bias, chunk_size=4).loss_sum
    torch.testing.assert_close(nested, flat, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("ignore_fraction", [0.0, 0.4, 1.0])
def test_precomputed_rows_give_the_same_loss_and_gradients(ignore_fraction):
    hidden, weight, bias, labels = _problem(ignore_fraction=ignore_fraction)
    rows = supervised_rows(labels, IGNORE)
    assert rows.tolist() == [i for i, y in enumerate(labels.reshape(-1).tolist()) if y != IGNORE]
    out, grads = _run(_fused, hidden, weight, labels, bias, chunk_size=5)
    got, got_grads = _run(_fused, hidden, weight, labels, bias, chunk_size=5, supervised_rows=rows)
    assert torch.equal(got.loss_sum, out.loss_sum) and torch.equal(got.num_tokens, out.num_tokens)
    for a, b in zip(got_grads, grads, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (torch.zeros(4), "1-d int64"),
        (torch.zeros(2, 2, dtype=torch.long), "1-d int64"),
        (torch.arange(49), "49 supervised_rows for 48 tokens"),
    ],
)
def test_bad_supervised_rows_raise(rows, message):
    hidden, weight, bias, labels = _problem()
    with pytest.raises(ValueError, match=message):
        _fused(hidden, weight, labels, bias, supervised_rows=rows)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(labels=torch.zeros(3, 15, dtype=torch.long)), "labels shape"),
        (dict(labels=torch.zeros(3, 16)), "integer"),
        (dict(labels=torch.full((3, 16), 24)), "outside the vocabulary"),
        (dict(labels=torch.full((3, 16), -5)), "outside the vocabulary"),
        (dict(weight=torch.zeros(24, 7, dtype=torch.float64)), r"weight must be \[vocab, hidden\]"),
        (dict(weight=torch.zeros(24, 8)), "weight dtype"),
        (dict(bias=torch.zeros(23, dtype=torch.float64)), "bias must be"),
        (dict(hidden=torch.zeros(3, 16, 8, dtype=torch.long)), "floating point"),
        (dict(chunk_size=0), "chunk_size"),
    ],
)
def test_bad_arguments_raise(change, message):
    hidden, weight, bias, labels = _problem()
    args = dict(hidden=hidden, weight=weight, bias=bias, labels=labels, chunk_size=4) | change
    with pytest.raises(ValueError, match=message):
        fused_linear_cross_entropy_sum(**args)
