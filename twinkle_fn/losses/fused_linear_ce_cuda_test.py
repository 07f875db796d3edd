"""`fused_linear_cross_entropy_sum` on a CUDA device: accuracy within a memory budget, the
float32 weight-gradient accumulation, the Triton kernel path against the torch path, and no host
sync with precomputed rows. Skipped without CUDA; the CPU behaviour is ``fused_linear_ce_test``'s."""

import pytest
import torch

from twinkle_fn.losses import fused_linear_ce, fused_linear_cross_entropy_sum
from twinkle_fn.losses.fused_linear_ce import supervised_rows
from twinkle_fn.losses.fused_linear_ce_test import (
    CUDA,
    IGNORE,
    _assert_as_accurate_as_plain,
    _fused,
    _plain,
    _problem,
    _relative_error,
    _run,
)
from twinkle_fn.testing import no_host_sync


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_as_accurate_as_plain_within_a_memory_budget(dtype):
    tokens, vocab, hidden_size, chunk = 4096, 32768, 256, 512
    hidden, weight, bias, labels = (
        None if t is None else t.detach().cuda().requires_grad_(t.requires_grad)
        for t in _problem(lead=(tokens,), hidden=hidden_size, vocab=vocab, dtype=dtype)
    )
    labels = labels.cuda()
    _run(_plain, hidden, weight, labels, bias)  # warm up cuBLAS outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out, grads = _run(_fused, hidden, weight, labels, bias, chunk_size=chunk)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    # a chunk of logits in float32 plus one copy in the input dtype; the float32 weight gradient
    # and the returned one (the matmul accumulates into the float32 one: no per-chunk
    # temporary); the stored and the returned hidden gradient; 16 MiB for cuBLAS workspaces and
    # index tensors.
    element = hidden.element_size()
    budget = (
        chunk * vocab * (4 + element)
        + vocab * hidden_size * (4 + element)
        + tokens * hidden_size * 2 * element
        + 2**24
    )
    assert peak < budget < tokens * vocab * 4
    del out, grads
    # float32 matmuls run without TF32 (torch's default), so both paths are near float64
    floor = 4e-3 if dtype == torch.bfloat16 else 1e-5
    _assert_as_accurate_as_plain(hidden, weight, bias, labels, chunk_size=chunk, floor=floor)


@pytest.mark.gpu
@CUDA
def test_cuda_weight_gradient_sums_chunks_in_float32_without_a_temporary():
    gen = torch.Generator(device="cuda").manual_seed(0)
    vocab, hidden_size, chunk, chunks = 8192, 512, 256, 16
    grad_logits = torch.randn(chunk, vocab, device="cuda", generator=gen).bfloat16()
    h = torch.randn(chunk, hidden_size, device="cuda", generator=gen).bfloat16()
    grad_weight = torch.zeros(vocab, hidden_size, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    for _ in range(chunks):
        fused_linear_ce._accumulate_weight_grad(grad_weight, grad_logits, h)
    torch.cuda.synchronize()
    # a bf16 [vocab, hidden] product would be 8 MiB; allow 4 MiB of cuBLAS workspace
    assert torch.cuda.max_memory_allocated() - before < 2**22
    expected = chunks * (grad_logits.double().t() @ h.double())
    # float32 sums of exact bf16 products: a few float32 ulps, where rounding each chunk's
    # partial sum to bf16 would cost ~2^-9 relative
    assert _relative_error(grad_weight, expected) < 1e-5


def _cuda_problem(dtype, tokens=3000, hidden_size=256, vocab=5000):
    """Leaves on CUDA in `dtype`, logits of unit scale, and labels with ~25% ignored."""
    gen = torch.Generator().manual_seed(5)
    leaves = [
        torch.randn(tokens, hidden_size, generator=gen),
        torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.5,
        torch.randn(vocab, generator=gen),
    ]
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    labels[torch.rand(tokens, generator=gen) < 0.25] = IGNORE
    leaves = [t.to("cuda", dtype).requires_grad_() for t in leaves]
    return leaves, labels.cuda()


def _both_paths(monkeypatch, leaves, labels, chunk_size=1024):
    """(kernel, torch) results and gradients of the fused loss on the same CUDA inputs."""
    from twinkle_fn.losses import _ce_kernel

    launches = []
    kernel = _ce_kernel.cross_entropy_rows_
    monkeypatch.setattr(
        _ce_kernel, "cross_entropy_rows_", lambda *a, **k: launches.append(1) or kernel(*a, **k)
    )
    results = []
    for use_kernel in (True, False):
        monkeypatch.setattr(fused_linear_ce, "_kernel_applies", lambda _, use=use_kernel: use)
        out = fused_linear_cross_entropy_sum(
            leaves[0],
            leaves[1],
            labels,
            bias=leaves[2],
            chunk_size=chunk_size,
            return_token_losses=True,
        )
        needed = [t for t in leaves if t.requires_grad]
        results.append((out, torch.autograd.grad(out.loss_sum, needed) if needed else ()))
    # 3000 tokens, ~2250 supervised: three chunks, all in the kernel
    assert len(launches) == 3
    return results


# (loss rtol, gradient rtol) per dtype. Both paths compute in float32 from the same logits, so
# losses differ by a few float32 ulps (hardware exp/log, summation order) of values ~10 and sums
# ~2e4. The logits gradient is that float32 value rounded once to the dtype; an ulp of float32
# difference moves some entries to the neighbouring value, which the matmuls carry as about one
# ulp of the dtype: 2^-7 for bf16, 2^-10 for fp16, and float32 stays at a few float32 ulps.
# The bias gradient differs a bit more in low precision: the kernel path sums the rounded
# gradient, the torch path the float32 one; atol scales with the largest entry for that.
KERNEL_TOLERANCES = {
    torch.bfloat16: (1e-5, 2**-7),
    torch.float16: (1e-5, 2**-10),
    torch.float32: (1e-5, 1e-5),
}


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("dtype", list(KERNEL_TOLERANCES))
def test_cuda_kernel_path_matches_the_torch_path(monkeypatch, dtype):
    loss_rtol, grad_rtol = KERNEL_TOLERANCES[dtype]
    leaves, labels = _cuda_problem(dtype)
    (kernel, grads), (ref, ref_grads) = _both_paths(monkeypatch, leaves, labels)
    torch.testing.assert_close(kernel.loss_sum, ref.loss_sum, rtol=loss_rtol, atol=0)
    assert kernel.loss_sum.dtype == torch.float32 and torch.equal(kernel.num_tokens, ref.num_tokens)
    torch.testing.assert_close(kernel.token_losses, ref.token_losses, rtol=loss_rtol, atol=1e-5)
    assert torch.all(kernel.token_losses[labels == IGNORE] == 0)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        assert grad.dtype == ref_grad.dtype == dtype
        atol = grad_rtol * ref_grad.abs().max().item()
        torch.testing.assert_close(grad, ref_grad, rtol=grad_rtol, atol=atol)
        # and on the whole well under one rounding of the dtype
        assert _relative_error(grad, ref_grad.double()) < grad_rtol / 2

    # evaluation: no gradient wanted, the kernel only reads the logits
    for leaf in leaves:
        leaf.requires_grad_(False)
    (kernel, _), (ref, _) = _both_paths(monkeypatch, leaves, labels)
    torch.testing.assert_close(kernel.token_losses, ref.token_losses, rtol=loss_rtol, atol=1e-5)


@pytest.mark.gpu
@CUDA
def test_cuda_with_precomputed_rows_never_syncs():
    hidden, weight, bias, labels = _problem(dtype=torch.bfloat16)
    hidden, weight, bias = (t.detach().cuda().requires_grad_() for t in (hidden, weight, bias))
    rows = supervised_rows(labels, IGNORE, "cuda")  # from CPU labels: no device sync
    labels = labels.cuda()
    with no_host_sync():
        out = _fused(hidden, weight, labels, bias, chunk_size=8, supervised_rows=rows)
        out.loss_sum.backward()
        with pytest.raises(RuntimeError, match="synchroniz"):
            _fused(hidden, weight, labels, bias, chunk_size=8)  # counts its rows: a sync
    assert hidden.grad is not None and torch.isfinite(out.loss_sum)
