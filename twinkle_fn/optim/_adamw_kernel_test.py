import contextlib
import math
import sys

import pytest
import torch

from twinkle_fn.optim import _adamw_kernel, adamw, apply_updates
from twinkle_fn.optim.base import ScaledUpdates, materialise
from twinkle_fn.pytree import tree_map
from twinkle_fn.testing import run_triton_interpreted

CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (the kernel's real target)"
)
LR, B1, B2, EPS = 1e-2, 0.9, 0.999, 1e-8
STEPS = 3
# "big" spans three programs (16K elements each, the last ragged); "t" is a transposed view that
# the kernel cannot index flat, so it must take the foreach path.
SHAPES = {"a": (3, 5), "big": (2 * 16384 + 5,), "c": (7,), "empty": (0,), "mat": (17, 1030)}
CASES = [(dtype, wd) for dtype in (torch.float32, torch.bfloat16) for wd in (0.0, 0.1)]
# Rounding once to the tensor dtype costs half an ulp on the GPU (one under Triton's CPU
# interpreter, whose float32 -> bf16 cast truncates); float32 registers add a few float32 ulps.
MATH_RTOL = {torch.float32: 2**-21, torch.bfloat16: 2**-7}
# Against the foreach path: in float32 the same operations (contractions aside: a few ulps); in
# bf16 the foreach path also rounds b2*v (1 ulp of v) and sqrt, the division, d and m/d (about
# 5 ulps of u) to bf16, and rounds lr*m/d before the decay is added, which cancels part of it:
# hence an absolute bound of a few bf16 ulps of lr there.
FOREACH_RTOL = {
    torch.float32: {"m": 2**-21, "v": 2**-21, "u": 2**-21},
    torch.bfloat16: {"m": 2**-7, "v": 2**-6, "u": 2**-4},
}
FOREACH_ATOL_U = {torch.float32: LR * 2**-20, torch.bfloat16: LR * 2**-6}


def _tensors(device, dtype, gen):
    out = {k: torch.randn(s, generator=gen).to(device, dtype) for k, s in SHAPES.items()}
    out["t"] = torch.randn(6, 8, generator=gen).to(device, dtype).t()
    return out


def _math(g, m, v, p, t, weight_decay):
    """One AdamW step in float64 from the same inputs: (m, v, u)."""
    g, m, v = g.double(), m.double(), v.double()
    m = m + (1 - B1) * (g - m)
    v = B2 * v + (1 - B2) * g * g
    u = -(LR / (1 - B1**t)) * m / (v.sqrt() / math.sqrt(1 - B2**t) + EPS)
    if weight_decay and p.dim() >= 2:  # the default mask decays matrices only
        u = u - LR * weight_decay * p.double()
    return m, v, u


def _close(actual, expected, rtol, atol, what):
    torch.testing.assert_close(
        actual.double(), expected.double(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}"
    )


@contextlib.contextmanager
def _kernel_calls(force: bool):
    """The ids of the gradients the kernel received; `force` sends CPU tensors to the kernel
    (which only Triton's interpreter can run)."""
    adamw_module = sys.modules["twinkle_fn.optim.adamw"]
    taken = set()
    launch = _adamw_kernel.adamw_step_

    def spy(grads, *args, **kwargs):
        taken.update(id(g) for g in grads)
        launch(grads, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_adamw_kernel, "adamw_step_", spy)
        if force:
            patch.setattr(adamw_module, "_kernel_applies", lambda t: True)
        yield taken


def check_kernel(device: str, dtype: torch.dtype, weight_decay: float, force: bool) -> None:
    """STEPS updates through the kernel, each compared from the same state with the foreach path
    and with float64 math; the non-contiguous leaf must have been left to the foreach path."""
    gen = torch.Generator().manual_seed(0)
    params = _tensors(device, dtype, gen)
    fused = adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=weight_decay)
    foreach = adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=weight_decay, fused=False)
    state = fused.init(params)
    for t in range(1, STEPS + 1):
        grads = _tensors(device, dtype, gen)
        before = tree_map(torch.clone, (grads, state, params))
        ref_grads, ref_state, ref_params = tree_map(torch.clone, before)
        ref_u, ref_state = foreach.update(ref_grads, ref_state, ref_params)
        with _kernel_calls(force) as taken:
            u, state = fused.update(grads, state, params)
        assert id(grads["t"]) not in taken and id(grads["mat"]) in taken, "wrong path"
        for k in params:
            got = {"m": state.mu[k], "v": state.nu[k], "u": u[k]}
            if k == "t":  # both took the foreach path
                for name, x in got.items():
                    assert torch.equal(
                        x, {"m": ref_state.mu, "v": ref_state.nu, "u": ref_u}[name][k]
                    )
                continue
            g0, s0, p0 = before[0][k], before[1], before[2][k]
            exact = dict(
                zip("mvu", _math(g0, s0.mu[k], s0.nu[k], p0, t, weight_decay), strict=True)
            )
            ref = {"m": ref_state.mu[k], "v": ref_state.nu[k], "u": ref_u[k]}
            # absolute floors: float32 error on terms of size |g| (m, v) and lr (u)
            atol = {"m": 2**-20, "v": 1e-12, "u": LR * 2**-20}
            for name, x in got.items():
                assert x.dtype == dtype and x.shape == p0.shape
                where = f"{dtype} wd={weight_decay} step {t} {k}.{name}"
                _close(x, exact[name], MATH_RTOL[dtype], atol[name], f"{where} vs float64")
                rtol = FOREACH_RTOL[dtype][name]
                floor = FOREACH_ATOL_U[dtype] if name == "u" else atol[name]
                _close(x, ref[name], rtol, floor, f"{where} vs foreach")
        apply_updates(params, u)


def check_scaled(device: str, force: bool) -> None:
    """A pending scale (`ScaledUpdates`) through the kernel equals the gradients multiplied in
    place first (float32), and every contiguous leaf took the kernel."""
    gen = torch.Generator().manual_seed(1)
    params = _tensors(device, torch.float32, gen)
    grads = _tensors(device, torch.float32, gen)
    scale = torch.tensor(3e-4, dtype=torch.float64, device=device)
    tx = adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=0.1)
    first = tree_map(torch.clone, (grads, tx.init(params), params))
    second = tree_map(torch.clone, first)
    with _kernel_calls(force) as taken:
        u, state = tx.update(ScaledUpdates(first[0], scale), first[1], first[2])
    assert id(first[0]["mat"]) in taken and id(first[0]["t"]) not in taken, "wrong path"
    with _kernel_calls(force):
        ref_u, ref_state = tx.update(materialise(ScaledUpdates(second[0], scale)), *second[1:])
    for k in params:
        for got, want in ((u, ref_u), (state.mu, ref_state.mu), (state.nu, ref_state.nu)):
            if device == "cpu":  # the interpreter rounds the product as a separate multiply
                assert torch.equal(got[k], want[k]), k
            else:  # the GPU may fuse it into the first moment's update: an ulp
                torch.testing.assert_close(got[k], want[k], rtol=2**-22, atol=1e-30, msg=k)


def check_all_interpreted() -> None:
    """Every case on CPU tensors; run under TRITON_INTERPRET=1."""
    for dtype, wd in CASES:
        check_kernel("cpu", dtype, wd, force=True)
    check_scaled("cpu", force=True)


def test_interpreted_kernel_matches_foreach_and_float64_math():
    run_triton_interpreted(
        "from twinkle_fn.optim._adamw_kernel_test import check_all_interpreted as c; c()"
    )


def test_bad_operands_raise():
    g = torch.zeros(4)
    common = dict(b1=B1, b2=B2, eps=EPS, step_size=-LR, bc2_sqrt=1.0, decay_scale=0.0)
    with pytest.raises(ValueError, match="must be contiguous"):
        _adamw_kernel.adamw_step_([g], [g.double()], [g], [None], **common)
    with pytest.raises(ValueError, match="is not one of"):
        d = g.double()
        _adamw_kernel.adamw_step_([d], [d.clone()], [d.clone()], [None], **common)
    with pytest.raises(ValueError, match="differ in shape"):
        _adamw_kernel.adamw_step_([g], [torch.zeros(2)], [g.clone()], [None], **common)
    for bad in (torch.ones(2), torch.tensor(1.0, dtype=torch.float64)):
        with pytest.raises(ValueError, match="grad_scale must be one float32 element"):
            _adamw_kernel.adamw_step_(
                [g], [g.clone()], [g.clone()], [None], **common, grad_scale=bad
            )


@CUDA
@pytest.mark.parametrize(("dtype", "weight_decay"), CASES)
def test_cuda_kernel_matches_foreach_and_float64_math(dtype, weight_decay):
    check_kernel("cuda", dtype, weight_decay, force=False)


@CUDA
def test_cuda_kernel_takes_a_pending_scale():
    check_scaled("cuda", force=False)


@CUDA
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_cuda_fused_adamw_matches_torch(weight_decay):
    # float32, six steps against torch.optim.AdamW on the same device: a few ulps (the decay's
    # rounding, fma contractions), as adamw_test's CPU comparison allows.
    gen = torch.Generator().manual_seed(0)
    init = {k: v for k, v in _tensors("cuda", torch.float32, gen).items() if k != "t"}
    refs = [torch.nn.Parameter(v.clone()) for v in init.values()]
    opt = torch.optim.AdamW(refs, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=weight_decay)
    ours = {k: v.clone() for k, v in init.items()}
    tx = adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=weight_decay, mask=None)
    state = tx.init(ours)
    for _ in range(6):
        grads = {k: torch.randn(v.shape, generator=gen).cuda() for k, v in init.items()}
        for r, g in zip(refs, grads.values(), strict=True):
            r.grad = g.clone()
        opt.step()
        with _kernel_calls(force=False) as taken:
            updates, state = tx.update(grads, state, ours)
        assert len(taken) == len(grads)
        apply_updates(ours, updates)
    for r, (k, p) in zip(refs, ours.items(), strict=True):
        torch.testing.assert_close(p, r.detach(), rtol=1e-6, atol=1e-7, msg=k)
