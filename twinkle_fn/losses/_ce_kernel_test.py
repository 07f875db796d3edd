import pytest
import torch

from twinkle_fn.losses import _ce_kernel, fused_linear_ce
from twinkle_fn.testing import run_triton_interpreted

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# A float32 result differs from torch's only by the order of the sums and the hardware exp/log:
# a few ulps of values up to ~10.
LOSS_TOLERANCE = dict(rtol=1e-5, atol=1e-5)
# The gradient is the same float32 value rounded to the logits dtype once; a float32 difference
# of a few ulps can move it to the neighbouring value: one ulp of the logits dtype.
GRAD_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def _rows(rows=9, vocab=50, dtype=torch.float32, bias=False, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    logits[0] += 1e4 if dtype == torch.float32 else 100  # a far-off max the online max must track
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    bias_t = torch.randn(vocab, generator=gen) if bias else None
    if bias:
        bias_t[:16] = float("-inf")  # a whole first block that is -inf must not give NaN
        labels = labels.clamp(min=16)
    to = dict(device=device)
    return logits.to(**to), labels.to(**to), None if bias_t is None else bias_t.to(**to)


def _reference(logits, labels, bias):
    """Per-row CE and ``softmax - onehot`` in float32 torch ops."""
    x = logits.float() if bias is None else logits.float() + bias
    loss = torch.logsumexp(x, 1) - x.gather(1, labels[:, None])[:, 0]
    onehot = torch.nn.functional.one_hot(labels, x.shape[1])
    return loss, (x.softmax(1) - onehot).to(logits.dtype)


def _check(module, device, dtype, bias, block):
    logits, labels, bias_t = _rows(dtype=dtype, bias=bias, device=device)
    ref_loss, ref_grad = _reference(logits, labels, bias_t)
    grad = logits.clone()
    loss = module.cross_entropy_rows_(grad, labels, bias_t, block=block)
    assert loss.dtype == torch.float32 and loss.shape == labels.shape
    torch.testing.assert_close(loss, ref_loss, **LOSS_TOLERANCE)
    assert grad.dtype == dtype
    torch.testing.assert_close(grad, ref_grad, rtol=GRAD_RTOL[dtype], atol=1e-6)
    # without write_grad the logits are only read
    untouched = logits.clone()
    loss = module.cross_entropy_rows_(untouched, labels, bias_t, write_grad=False, block=block)
    assert torch.equal(untouched, logits)
    torch.testing.assert_close(loss, ref_loss, **LOSS_TOLERANCE)


def _fused_inputs(dtype):
    """hidden [40, 16], weight [72, 16], bias [72] (leaves in `dtype`) and labels, 30% ignored."""
    gen = torch.Generator().manual_seed(3)
    tokens, hidden_size, vocab = 40, 16, 72
    inputs = [
        torch.randn(tokens, hidden_size, generator=gen),
        torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.5,
        torch.randn(vocab, generator=gen),
    ]
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    labels[torch.rand(tokens, generator=gen) < 0.3] = -100
    return [t.to(dtype).requires_grad_() for t in inputs], labels


def _fused(inputs, labels):
    """The fused loss with its per-token losses, and the gradients of its sum."""
    hidden, weight, bias = inputs
    out = fused_linear_ce.fused_linear_cross_entropy_sum(
        hidden, weight, labels, bias=bias, chunk_size=16, return_token_losses=True
    )
    return out, torch.autograd.grad(out.loss_sum, inputs)


ROW_CASES = [
    (dtype, bias, block)
    for dtype in GRAD_RTOL
    for bias in (False, True)
    for block in (16, None)  # several loop steps with a ragged last one; one step
]
FUSED_DTYPES = [torch.float32, torch.bfloat16]


def run_cases(path: str) -> None:
    """Run every case through `_ce_kernel`, results to `path`; TRITON_INTERPRET=1 runs it on CPU."""
    rows = {}
    for dtype, bias, block in ROW_CASES:
        logits, labels, bias_t = _rows(dtype=dtype, bias=bias)
        grad = logits.clone()
        loss = _ce_kernel.cross_entropy_rows_(grad, labels, bias_t, block=block)
        untouched = logits.clone()
        eval_loss = _ce_kernel.cross_entropy_rows_(
            untouched, labels, bias_t, write_grad=False, block=block
        )
        rows[dtype, bias, block] = loss, grad, eval_loss, untouched
    logits, labels, _ = _rows()
    labels[[1, 2]] = torch.tensor([-1, 50])
    out_of_range = _ce_kernel.cross_entropy_rows_(logits, labels, write_grad=False)
    empty = _ce_kernel.cross_entropy_rows_(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long))
    fused = {}
    with pytest.MonkeyPatch.context() as patch:
        # the kernel path on CPU tensors, which only the interpreter can run
        patch.setattr(fused_linear_ce, "_kernel_applies", lambda _: True)
        for dtype in FUSED_DTYPES:
            out, grads = _fused(*_fused_inputs(dtype))
            fused[dtype] = tuple(t.detach() for t in out), grads
    torch.save(dict(rows=rows, out_of_range=out_of_range, empty=empty, fused=fused), path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """`run_cases`' results with the kernel run by Triton's CPU interpreter, in a subprocess:
    TRITON_INTERPRET must be set before triton is first imported."""
    path = tmp_path_factory.mktemp("interpreted") / "results.pt"
    script = "import sys; from twinkle_fn.losses._ce_kernel_test import run_cases; run_cases(sys.argv[1])"
    run_triton_interpreted(script, str(path))
    return torch.load(path)


def _check_rows(logits, labels, bias, results):
    loss, grad, eval_loss, untouched = results
    ref_loss, ref_grad = _reference(logits, labels, bias)
    assert loss.dtype == torch.float32 and loss.shape == labels.shape
    torch.testing.assert_close(loss, ref_loss, **LOSS_TOLERANCE)
    assert grad.dtype == logits.dtype
    torch.testing.assert_close(grad, ref_grad, rtol=GRAD_RTOL[logits.dtype], atol=1e-6)
    # without write_grad the logits are only read
    assert torch.equal(untouched, logits)
    torch.testing.assert_close(eval_loss, ref_loss, **LOSS_TOLERANCE)


@pytest.mark.parametrize(("dtype", "bias", "block"), ROW_CASES)
def test_interpreted_kernel_matches_torch(interpreted, dtype, bias, block):
    _check_rows(*_rows(dtype=dtype, bias=bias), interpreted["rows"][dtype, bias, block])


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize(("dtype", "bias", "block"), ROW_CASES)
def test_cuda_kernel_matches_torch(dtype, bias, block):
    logits, labels, bias_t = _rows(dtype=dtype, bias=bias, device="cuda")
    grad, untouched = logits.clone(), logits.clone()
    results = (
        _ce_kernel.cross_entropy_rows_(grad, labels, bias_t, block=block),
        grad,
        _ce_kernel.cross_entropy_rows_(untouched, labels, bias_t, write_grad=False, block=block),
        untouched,
    )
    _check_rows(logits, labels, bias_t, results)


def test_out_of_range_label_gives_nan_loss(interpreted):
    loss = interpreted["out_of_range"]  # labels -1 and 50 (= vocab) in rows 1 and 2
    assert loss[1:3].isnan().all() and not loss[[0, *range(3, 9)]].isnan().any()
    assert interpreted["empty"].shape == (0,)


@pytest.mark.parametrize("dtype", FUSED_DTYPES)
def test_interpreted_kernel_path_of_the_fused_loss(interpreted, dtype):
    (loss_sum, num_tokens, token_losses), kernel_grads = interpreted["fused"][dtype]
    ref, ref_grads = _fused(*_fused_inputs(dtype))  # the torch path, on CPU
    torch.testing.assert_close(loss_sum, ref.loss_sum.detach(), **LOSS_TOLERANCE)
    torch.testing.assert_close(token_losses, ref.token_losses, **LOSS_TOLERANCE)
    assert torch.equal(num_tokens, ref.num_tokens)
    for grad, ref_grad in zip(kernel_grads, ref_grads, strict=True):
        # hidden/weight: one ulp of a rounded logits gradient moves a matmul by about one ulp;
        # bias: the kernel path sums the rounded gradient, the torch path the float32 one
        rtol = GRAD_RTOL[dtype]
        atol = rtol * ref_grad.abs().max().item()
        torch.testing.assert_close(grad, ref_grad, rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    ("logits", "labels", "bias", "message"),
    [
        (torch.zeros(4, 6).t(), torch.zeros(6, dtype=torch.long), None, "unit stride"),
        (torch.zeros(4, 0), torch.zeros(4, dtype=torch.long), None, "vocab > 0"),
        (torch.zeros(4, 6, dtype=torch.float64), torch.zeros(4, dtype=torch.long), None, "dtype"),
        (torch.zeros(4, 6), torch.zeros(4, dtype=torch.int32), None, "int64"),
        (torch.zeros(4, 6), torch.zeros(5, dtype=torch.long), None, r"\[rows\] = \[4\]"),
        (torch.zeros(4, 6), torch.zeros(4, dtype=torch.long), torch.zeros(6).half(), "float32"),
        (torch.zeros(4, 6), torch.zeros(4, dtype=torch.long), torch.zeros(5), r"\[vocab\] = \[6\]"),
    ],
)
def test_bad_arguments_raise(logits, labels, bias, message):
    with pytest.raises(ValueError, match=message):
        _ce_kernel.cross_entropy_rows_(logits, labels, bias)
