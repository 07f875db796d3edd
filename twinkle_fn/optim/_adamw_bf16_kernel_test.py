"""The one-pass `adamw_bf16` kernel lands where the torch reference path does: on a bf16
neighbour of the same float32 step (a float32 parameter: the same value), unbiased, with the
gradient zeroed; run under Triton's CPU interpreter, and on CUDA when there is one."""

import sys

import pytest
import torch

from twinkle_fn.optim import _adamw_bf16_kernel, adamw_bf16
from twinkle_fn.testing import run_triton_interpreted

CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (the kernel's real target)"
)
LR = 1e-3
# "big" spans several programs (1024 elements each, the last ragged)
SHAPES = {"w": (37, 70), "big": (3 * 1024 + 5,), "b": (7,)}


def _leaves(device, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen).to(device, dtype) for k, s in SHAPES.items()}


def _step(device, p_dtype, g_dtype, kernel: bool):
    """One update from zero moments; the parameters, moments and gradient after it."""
    module = sys.modules["twinkle_fn.optim.adamw_bf16"]
    params = _leaves(device, p_dtype, 0)
    tx = adamw_bf16(LR, weight_decay=0.1)
    state = tx.init(params)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "_kernel_applies", lambda g, p: kernel)
        grads = _leaves(device, g_dtype, 1)
        tx.update(grads, state, params)
    return params, state, grads


def _ulp(x):
    """The bf16 ulp at each value of `x` (float32)."""
    exponent = torch.frexp(x.float().abs().clamp(min=2.0**-126))[1]
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exponent - 8)


def check_kernel(device: str) -> None:
    # bf16 parameters with bf16 (transformers) or float32 (megatron's buffer) gradients, and
    # float32 parameters
    for p_dtype, g_dtype in (
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
    ):
        ref_p, ref_s, _ = _step(device, p_dtype, g_dtype, kernel=False)
        p, s, g = _step(device, p_dtype, g_dtype, kernel=True)
        for k in SHAPES:
            assert not g[k].any(), k
            assert p[k].dtype == p_dtype and s.mu[k].dtype == torch.bfloat16
            # Both paths round (nearly) one float32 value stochastically, with their own
            # random bits: the same bf16 or its neighbour (two ulps where the float32 values
            # differ across a bf16 boundary).
            for got, ref in ((s.mu[k], ref_s.mu[k]), (s.nu[k], ref_s.nu[k]), (p[k], ref_p[k])):
                if got.dtype == torch.float32:  # the first update reads unrounded moments
                    torch.testing.assert_close(got, ref, rtol=2**-21, atol=LR * 2**-20)
                    continue
                diff = (got.float() - ref.float()).abs()
                assert bool((diff <= 2 * _ulp(ref)).all()), k
    # unbiased: parameters at 1.0 taking steps of about a third of an ulp
    n = 1 << 13
    p = torch.ones(n, dtype=torch.bfloat16, device=device)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    g = torch.full((n,), 1.0, device=device)
    step = 2**-8 / 3  # ulp below 1.0 is 2**-8
    _adamw_bf16_kernel.adamw_bf16_step_(
        g,
        m,
        v,
        p,
        seed=7,
        b1=0.9,
        b2=0.999,
        eps=0.0,
        step_size=-step,
        bc2_sqrt=1.0,
        decay_scale=0.0,
    )
    # m/denom = 0.1 / sqrt(0.001) = 3.162...; the exact result is 1 - 3.162 * step
    exact = 1.0 - step * 0.1 / 0.001**0.5
    mean = float(p.double().mean())
    # 5 standard errors of a Bernoulli over n draws, in ulps of 2**-8
    assert abs(mean - exact) < 5 * (0.25 / n) ** 0.5 * 2**-8
    assert set(p.float().unique().tolist()) <= {1.0 - 2 * 2**-8, 1.0 - 2**-8, 1.0}


def check_scaled(device: str) -> None:
    """A pending scale is multiplied into the gradient in float32 as the kernel reads it: the
    step equals the kernel's on that product computed first, with the same random bits. The
    moments start at the scaled gradients' size, so that a wrong scale moves them."""
    gen = torch.Generator().manual_seed(2)
    n = SHAPES["big"]
    scale = torch.tensor(3e-4, device=device)
    common = dict(seed=11, b1=0.9, b2=0.999, eps=1e-8, step_size=-LR, bc2_sqrt=1.0)
    for g_dtype in (torch.bfloat16, torch.float32):
        g = torch.randn(n, generator=gen).to(device, g_dtype)
        p = torch.randn(n, generator=gen).to(device, torch.bfloat16)
        m = (torch.randn(n, generator=gen) * 3e-4).to(device, torch.bfloat16)
        v = (torch.rand(n, generator=gen) * 1e-7).to(device, torch.bfloat16)
        runs = []
        for grad, grad_scale in ((g.clone(), scale), (g.float() * scale, None)):
            ops = (grad, m.clone(), v.clone(), p.clone())
            _adamw_bf16_kernel.adamw_bf16_step_(
                *ops, **common, decay_scale=-LR * 0.1, grad_scale=grad_scale
            )
            runs.append(ops[1:])
        for got, want, before in zip(*runs, (m, v, p), strict=True):
            assert not torch.equal(want, before)  # the step moved it
            if device == "cpu":  # the interpreter rounds the product as a separate multiply
                assert torch.equal(got, want), g_dtype
            else:  # the GPU may fuse it into the first moment's update: a bf16 neighbour
                diff = (got.float() - want.float()).abs()
                assert bool((diff <= _ulp(want)).all()), g_dtype


def check_interpreted() -> None:
    check_kernel("cpu")
    check_scaled("cpu")


def test_interpreted_kernel_matches_the_torch_path():
    run_triton_interpreted(
        "from twinkle_fn.optim._adamw_bf16_kernel_test import check_interpreted as c; c()"
    )


def test_bad_operands_raise():
    g = torch.zeros(4, dtype=torch.bfloat16)
    common = dict(seed=0, b1=0.9, b2=0.999, eps=1e-8, step_size=-LR, bc2_sqrt=1.0, decay_scale=0)
    with pytest.raises(ValueError, match="m must be contiguous"):
        _adamw_bf16_kernel.adamw_bf16_step_(g, g.float(), g.clone(), g.clone(), **common)
    with pytest.raises(ValueError, match="p must be contiguous"):
        _adamw_bf16_kernel.adamw_bf16_step_(g, g.clone(), g.clone(), torch.zeros(2), **common)
    for bad in (torch.ones(2), torch.tensor(1.0, dtype=torch.float64)):
        with pytest.raises(ValueError, match="grad_scale must be one float32 element"):
            _adamw_bf16_kernel.adamw_bf16_step_(
                g, g.clone(), g.clone(), g.clone(), **common, grad_scale=bad
            )


@CUDA
def test_cuda_kernel_matches_the_torch_path():
    check_kernel("cuda")


@CUDA
def test_cuda_kernel_takes_a_pending_scale():
    check_scaled("cuda")
