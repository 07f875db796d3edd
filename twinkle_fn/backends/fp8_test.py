"""The float8 linear's numerics on torch's CPU ``_scaled_mm`` (the real op; torch 2.13's CPU build
runs it as a reference kernel), against a float64 reference of the quantise-dequantise math.

Bounds. With power-of-two scales the only rounding of an operand is its cast to float8, to
nearest: relative error <= u (e4m3: u = 2^-4, 3 mantissa bits; e5m2: 2^-3) for a scaled value
in the normal range, absolute error <= half the smallest subnormal step (e4m3: 2^-10, e5m2:
2^-17) times the scale below it. `_bound` turns these into an elementwise bound on a product.
"""

import pytest
import torch

from twinkle_fn.backends.fp8 import (
    E4M3,
    E5M2,
    check_device,
    check_linear,
    check_setting,
    check_store_setting,
    dequantise,
    fp8_linear,
    fp8_matmul,
    quantise,
    quantise_columns,
    quantise_reference,
    store_weight,
)

# (unit roundoff, half the smallest subnormal step) of each format, in scaled units
_ROUNDING = {E4M3: (2.0**-4, 2.0**-10), E5M2: (2.0**-3, 2.0**-17)}


def _operand_error(t, dtype, rowwise):
    """Elementwise bound on |dequant(quant(t)) - t| (float64)."""
    u, sub = _ROUNDING[dtype]
    _, s = quantise(t, dtype, rowwise)
    return torch.maximum(u * t.double().abs(), sub * s.double().expand_as(t))


def _bound(a, a_dtype, b_t, rowwise):
    """Elementwise bound on |deq(a) @ deq(b_t).T - a @ b_t.T|, operands quantised along dim 1:
    |ea| |b| + |a| |eb| + |ea| |eb|."""
    ea, eb = _operand_error(a, a_dtype, rowwise), _operand_error(b_t, E4M3, rowwise)
    a, b = a.double().abs(), b_t.double().abs()
    return ea @ b.T + a @ eb.T + ea @ eb.T


def _data(m=20, k=32, n=48, seed=0):
    """x [m, k] with one outlier token (x10^4), w [n, k], an output gradient [m, n] with an
    all-zero row (an unsupervised token): what rowwise scaling is for."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[3] *= 1e4
    w = torch.randn(n, k, generator=g) * 0.05
    dy = torch.randn(m, n, generator=g)
    dy[5] = 0.0
    return x, w, dy


@pytest.mark.parametrize("rowwise", [True, False])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantise_scales_are_powers_of_two_and_round_to_nearest(rowwise, dtype):
    x, _, _ = _data()
    q, s = quantise(x, dtype, rowwise)
    assert q.dtype == dtype and s.dtype == torch.float32
    assert s.shape == ((x.shape[0], 1) if rowwise else ())
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # powers of two: exact rescaling
    fmax = torch.finfo(dtype).max
    peak = (q.float().abs().amax(dim=1) if rowwise else q.float().abs().amax()) / fmax
    assert peak.gt(0.5 * 0.93).all() and peak.le(1.0).all()  # the peak lands in (max/2, max]
    err = (quantise_reference(x, dtype, rowwise) - x.double()).abs()
    assert (err <= _operand_error(x, dtype, rowwise)).all()
    assert err.max() > 0  # it did round


def test_an_all_zero_row_quantises_to_zeros_with_a_finite_scale():
    q, s = quantise(torch.zeros(2, 16), E4M3, True)
    assert torch.equal(q.float(), torch.zeros(2, 16)) and torch.isfinite(s).all()


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantise_columns_is_rowwise_quantise_of_the_transpose_bit_for_bit(dtype):
    x, _, dy = _data()
    for t in (x, dy.bfloat16()):
        q, s = quantise_columns(t, dtype)
        q_ref, s_ref = quantise(t.t().contiguous(), dtype, rowwise=True)
        assert q.shape == q_ref.shape and s.shape == s_ref.shape and s.stride() == (1, 1)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
        assert torch.equal(s, s_ref)


def test_tensorwise_keeps_float8_operands_for_backward_rowwise_the_compute_dtype():
    """Tensorwise backward reuses forward's quantised operands (1 byte an element saved instead
    of the activation's 4 here); rowwise re-quantises per column, so it keeps the inputs."""
    x, w, _ = _data()
    x.requires_grad_(True)
    for recipe, want in (("tensorwise", {E4M3, torch.float32}), ("rowwise", {torch.float32})):
        saved: set[torch.dtype] = set()

        def pack(t, saved=saved):
            saved.add(t.dtype)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fp8_matmul(x, w, recipe)
        assert saved == want, recipe


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_forward_and_backward_equal_the_quantise_dequantise_reference(recipe):
    """Each of the three GEMMs equals the float64 product of its dequantised float8 operands
    (float32 output: only float32 accumulation differs, rtol 1e-6). 20 tokens exercise the
    weight-gradient GEMM's padding to 32."""
    rowwise = recipe == "rowwise"
    grad_dtype = E4M3 if rowwise else E5M2
    x, w, dy = _data()
    x.requires_grad_(True)
    w.requires_grad_(True)
    y = fp8_matmul(x, w, recipe)
    y.backward(dy)

    def ref(a, a_dtype, b_t):
        return quantise_reference(a, a_dtype, rowwise) @ quantise_reference(b_t, E4M3, rowwise).T

    x0, w0 = x.detach(), w.detach()
    expected = {
        "y": (y, ref(x0, E4M3, w0)),
        "dx": (x.grad, ref(dy, grad_dtype, w0.T.contiguous())),
        "dw": (w.grad, ref(dy.T.contiguous(), grad_dtype, x0.T.contiguous())),
    }
    for name, (got, want) in expected.items():
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6, msg=name)


def test_check_store_setting():
    assert check_store_setting({}) is False
    assert check_store_setting({"fp8": "rowwise", "fp8_store_frozen": True}) is True
    with pytest.raises(ValueError, match="option fp8_store_frozen=1 must be True or False"):
        check_store_setting({"fp8": "rowwise", "fp8_store_frozen": 1})
    with pytest.raises(ValueError, match=r"set option fp8 \('tensorwise' or 'rowwise'\) too"):
        check_store_setting({"fp8_store_frozen": True})


def test_a_stored_weight_dequantises_exactly_and_stores_again_bit_for_bit():
    _, w, _ = _data()
    wq, s = store_weight(w)
    assert wq.dtype == E4M3 and s.shape == () and torch.equal(wq, quantise(w, E4M3, False)[0])
    dense = dequantise(wq, s)
    assert dense.dtype == torch.float32
    assert torch.equal(dense.double(), quantise_reference(w, E4M3, rowwise=False))
    again, s2 = store_weight(dense)
    assert torch.equal(again.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(s2, s)


def test_a_stored_weight_under_tensorwise_gives_the_frozen_weights_numbers_bit_for_bit():
    """Storing a frozen weight in float8 changes no number of the tensorwise recipe: its
    forward and input gradient equal `fp8_matmul`'s with the same weight frozen, exactly."""
    x, w, dy = _data()
    wq, s = store_weight(w)
    outs = []
    for stored in (False, True):
        xi = x.clone().requires_grad_(True)
        y = fp8_matmul(xi, wq, "tensorwise", s) if stored else fp8_matmul(xi, w, "tensorwise")
        y.backward(dy)
        outs.append((y, xi.grad))
    for got, want in zip(outs[1], outs[0], strict=True):
        assert torch.equal(got, want)


def test_a_stored_weight_under_rowwise_equals_the_quantise_dequantise_reference():
    """Rowwise with a stored weight: activations and gradients per row, the weight's one scale
    (float64 reference, float32 accumulation: rtol 1e-6)."""
    x, w, dy = _data()
    wq, s = store_weight(w)
    x.requires_grad_(True)
    y = fp8_matmul(x, wq, "rowwise", s)
    y.backward(dy)
    w_ref = dequantise(wq, s).double()
    x_ref = quantise_reference(x.detach(), E4M3, rowwise=True)
    dy_ref = quantise_reference(dy, E4M3, rowwise=True)
    torch.testing.assert_close(y.double(), x_ref @ w_ref.T, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), dy_ref @ w_ref, rtol=1e-6, atol=1e-6)


def test_a_stored_weight_is_all_backward_keeps_of_it():
    """Backward keeps the stored weight itself (no copy) and its scale, and no activation."""
    x, w, _ = _data()
    wq, s = store_weight(w)
    x.requires_grad_(True)
    for recipe in ("rowwise", "tensorwise"):
        saved = []

        def pack(t, saved=saved):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fp8_matmul(x, wq, recipe, s)
        assert len(saved) == 2 and saved[0] is wq and saved[1] is s, recipe


def test_a_float8_weight_needs_its_scale_and_a_scale_its_float8_weight():
    x, w, _ = _data()
    wq, s = store_weight(w)
    with pytest.raises(ValueError, match="needs its scale"):
        fp8_matmul(x, wq, "tensorwise")
    with pytest.raises(ValueError, match="needs its scale, any other none"):
        fp8_matmul(x, w, "tensorwise", s)


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_bf16_fp8_linear_is_within_float8_rounding_of_a_bf16_linear(recipe):
    """bf16 operands: the fp8 linear's output and gradients differ from a bf16 linear's by at
    most the float8 operand bound (`_bound`, from e4m3's 3 mantissa bits / e5m2's 2) plus both
    results' bf16 rounding (2^-9 relative each, doubled for float32 accumulation slack)."""
    rowwise = recipe == "rowwise"
    grad_dtype = E4M3 if rowwise else E5M2
    x, w, dy = (t.bfloat16() for t in _data())
    xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = fp8_matmul(xs, ws, recipe)
    y.backward(dy)
    y_ref = torch.nn.functional.linear(xr, wr)
    y_ref.backward(dy)
    assert y.dtype == torch.bfloat16 and ws.grad.dtype == torch.bfloat16
    cases = {
        "y": (y, y_ref, _bound(x, E4M3, w, rowwise)),
        "dx": (xs.grad, xr.grad, _bound(dy, grad_dtype, w.T.contiguous(), rowwise)),
        "dw": (ws.grad, wr.grad, _bound(dy.T.contiguous(), grad_dtype, x.T.contiguous(), rowwise)),
    }
    for name, (got, want, bound) in cases.items():
        diff = (got.double() - want.double()).abs()
        slack = 2.0**-8 * (got.double().abs() + want.double().abs())
        assert (diff <= bound + slack).all(), name
        assert diff.max() > 0, name  # the float8 path ran


def test_fp8_linear_under_autocast_casts_like_autocast_and_adds_the_bias():
    """Float32 master weight, bf16 autocast: output bf16, weight and bias gradients float32
    (through the cast), equal to an explicit bf16 fp8_matmul + bias."""
    x, w, dy = _data(m=16)
    b = torch.randn(w.shape[0])
    w.requires_grad_(True)
    b.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8_linear(x, w, b, "rowwise")
    y.backward(dy.bfloat16())
    assert y.dtype == torch.bfloat16 and w.grad.dtype == b.grad.dtype == torch.float32
    expected = fp8_matmul(x.bfloat16(), w.detach().bfloat16(), "rowwise") + b.detach().bfloat16()
    assert torch.equal(y, expected)
    torch.testing.assert_close(b.grad, dy.bfloat16().float().sum(0), rtol=1e-2, atol=1e-2)


def test_leading_dimensions_are_flattened_and_restored():
    x, w, _ = _data(m=24)
    y = fp8_matmul(x.view(2, 12, -1), w, "rowwise")
    assert y.shape == (2, 12, w.shape[0])
    assert torch.equal(y.view(24, -1), fp8_matmul(x, w, "rowwise"))


def test_settings_and_refusals():
    assert check_setting(None) is None and check_setting(False) is None
    assert check_setting("rowwise") == "rowwise"
    for bad in ("hybrid", True, "e4m3"):
        with pytest.raises(ValueError, match=r"option fp8=.* is not a recipe; use one of"):
            check_setting(bad)
    with pytest.raises(ValueError, match="fp8 recipe 'rowise' is not one of"):
        fp8_matmul(torch.zeros(2, 16), torch.zeros(16, 16), "rowise")
    check_linear("layers.0.self_attn.q_proj", 32, 64)
    msg = r"linear layers.0.mlp.down_proj has a weight of shape \[896, 4856\] \(tp=2\), .*16"
    with pytest.raises(ValueError, match=msg):
        check_linear("layers.0.mlp.down_proj", 896, 4856, " (tp=2)")
    check_device(torch.device("cpu"))  # torch's CPU build runs _scaled_mm


def test_a_gpu_below_compute_capability_8_9_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"compute capability >= 8.9.*A100 is 8.0. Leave fp8 off"):
        check_device(torch.device("cuda", 0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU)")
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_cuda_gemms_equal_the_quantise_dequantise_reference(recipe):
    """The GPU's three scaled GEMMs on bf16 operands against the float64 product of the same
    dequantised float8 operands (quantised on the GPU: `quantise` is the same torch code on both
    devices). The float8 products are exact in float32, so what differs is accumulation (Hopper's
    fast forward accumulation keeps fewer bits) and the bf16 output's rounding (2^-9): each entry
    within 2^-7 of the float64 product of the operands' absolute values, which bounds both
    without failing on entries that cancel toward zero."""
    check_device(torch.device("cuda"))
    rowwise = recipe == "rowwise"
    grad_dtype = E4M3 if rowwise else E5M2
    x, w, dy = (t.bfloat16().cuda() for t in _data(m=200, k=256, n=512))
    xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = fp8_matmul(xs, ws, recipe)
    y.backward(dy)

    def ref(a, a_dtype, b_t):
        qa = quantise_reference(a, a_dtype, rowwise)
        qb = quantise_reference(b_t, E4M3, rowwise)
        return qa @ qb.T, qa.abs() @ qb.abs().T

    cases = {
        "y": (y, ref(x, E4M3, w)),
        "dx": (xs.grad, ref(dy, grad_dtype, w.T.contiguous())),
        "dw": (ws.grad, ref(dy.T.contiguous(), grad_dtype, x.T.contiguous())),
    }
    for name, (got, (want, scale)) in cases.items():
        assert got is not None and got.dtype == torch.bfloat16, name
        diff = (got.double() - want).abs()
        assert (diff <= 2.0**-7 * scale).all(), f"{name}: {(diff / scale).max().item():.3g}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU)")
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_cuda_stored_weight_gemms(recipe):
    """A weight stored in float8 on the GPU: tensorwise, forward and input gradient equal the
    frozen bf16 weight's bit for bit; rowwise (the weight's one scale spread over its rows, as
    the GEMM's rowwise scaling takes it), within the bound of the test above of the float64
    product of the dequantised operands."""
    check_device(torch.device("cuda"))
    x, w, dy = (t.bfloat16().cuda() for t in _data(m=200, k=256, n=512))
    wq, s = store_weight(w)
    xs = x.clone().requires_grad_(True)
    y = fp8_matmul(xs, wq, recipe, s)
    y.backward(dy)
    if recipe == "tensorwise":
        xr = x.clone().requires_grad_(True)
        yr = fp8_matmul(xr, w, recipe)
        yr.backward(dy)
        assert torch.equal(y, yr) and torch.equal(xs.grad, xr.grad)
        return
    wd = dequantise(wq, s).double()
    cases = {
        "y": (y, quantise_reference(x, E4M3, True), wd.T),
        "dx": (xs.grad, quantise_reference(dy, E4M3, True), wd),
    }
    for name, (got, a, b) in cases.items():
        want, scale = a @ b, a.abs() @ b.abs()
        diff = (got.double() - want).abs()
        assert (diff <= 2.0**-7 * scale).all(), f"{name}: {(diff / scale).max().item():.3g}"
