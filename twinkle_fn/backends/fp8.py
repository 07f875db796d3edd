"""The model option ``fp8``: decoder linears whose three GEMMs run in float8 (``torch._scaled_mm``).

``fp8="rowwise"`` (or ``"tensorwise"``) makes each trained linear of the decoder layers (the
attention's q/k/v/o and the MLP's; not the embedding, the lm_head or a router) compute
``y = x @ w.T`` with `fp8_matmul`: an autograd function that quantises its operands to float8
inside forward and backward and multiplies them on torch's scaled GEMM. Weights, activations
between layers and gradients stay in the compute dtype (bf16 under ``precision="bf16"``) and
the optimizer's master weights are untouched: only the three GEMMs of a linear see float8.

Scaling is dynamic (from each operand's absolute maximum, every call; no amax history) and the
scales are powers of two, so scaling is exact and the only rounding is the float8 cast itself
(and `quantise_reference` reproduces the quantised operands bit for bit).

- ``"rowwise"`` (the finer numerics): one scale per row of each operand along the GEMM's
  non-contracted dimension (per token for activations and output gradients in the forward and
  input-gradient GEMMs, per output / input feature for the weight), all in e4m3. A token whose
  activations are 100x the others' (LLM activations have such outliers) then costs only its own
  row precision; with one scale per tensor it pushes every other row toward e4m3's subnormals.
  Per-row scales make e4m3 (3 mantissa bits, range 2^-9..448) enough for gradients too, as
  torchao's rowwise recipe finds, so no GEMM needs e5m2's coarser 2 mantissa bits. Its cost: the
  weight-gradient GEMM contracts over tokens, so its operands are scaled per column (a second
  quantisation of the activation and the gradient, over the other dimension).
- ``"tensorwise"`` (the faster): one scale per tensor; e4m3 for activations and weights, e5m2
  for output gradients (whose range across tokens one scale must cover). An operand's float8
  copy then serves every GEMM it enters, so backward reuses forward's and quantises only the
  output gradient. On one H200 (`benchmarks/RESULTS.md`) tensorwise runs 1.18x the bf16
  compiled step at the 1.5B shape and 1.24x at 4B (transformers backend; megatron 1.12x and
  1.17x), rowwise 1.01-1.10x; over 200 steps at 0.5B both end within 0.05 of bf16's loss.

With power-of-two scales, float8's relative rounding does not depend on the scale, so the
two recipes quantise an e4m3 operand alike except for values more than ~2^15 below their scale
group's maximum (e4m3's subnormals): per-row scales matter for wide-ranged tensors (gradients),
and the gradients' format (e4m3 or e5m2) matters throughout.

Requirements (`check_device`, `check_linear`): a CUDA device of compute capability >= 8.9
(Ada, Hopper and later; torch's CPU build also runs ``_scaled_mm``, as a reference kernel,
which is what the CPU tests use), and both dimensions of every converted linear (on this rank,
after tensor parallelism splits it) multiples of 16, as the GEMM requires. The token count is
free: the weight-gradient GEMM, which contracts over tokens, pads them with zero rows to a
multiple of 16 (zeros add nothing to the product and leave every scale unchanged).

A frozen linear (a LoRA base) runs its forward and input-gradient GEMMs in float8 too, and has
no weight-gradient GEMM; backward then keeps only the weight (`_FP8Matmul`). Those two GEMMs are
most of a LoRA step's work; the adapters' rank-r factors are too small for float8 to pay and
keep the compute dtype.

A frozen weight may also be *stored* in float8 (`store_weight`; the model option
``fp8_store_frozen``, `check_store_setting`, on both backends): e4m3 with one power-of-two scale, exactly what the tensorwise
recipe makes of it in every forward, so its GEMMs give the same numbers while the weight takes
one byte an element instead of two and no step quantises it again (`fp8_linear` with the
stored weight and its scale). Under ``"rowwise"`` such a weight keeps its one scale (a
tensorwise scale is a rowwise one whose rows agree); activations and gradients stay per row.
`dequantise` gives its values back, exactly (power-of-two scales), for a checkpoint or an export.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

RECIPES = ("rowwise", "tensorwise")
E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
# The GEMM's alignment: every dimension but the first operand's rows a multiple of 16.
ALIGN = 16
# Floor on an operand's absolute maximum: an all-zero row (a padded or unsupervised token's
# gradient) gets a finite scale and quantises to zeros.
_AMAX_FLOOR = 1e-12


def check_setting(value: object) -> str | None:
    """The recipe the option ``fp8`` names: ``None`` for ``None`` / ``False`` (off), else one of
    `RECIPES`. Raises ``ValueError`` for anything else, naming the value and the choices."""
    if value is None or value is False:
        return None
    if value not in RECIPES:
        raise ValueError(
            f"option fp8={value!r} is not a recipe; use one of {', '.join(map(repr, RECIPES))} "
            "(float8 linears through torch._scaled_mm), or None for the compute dtype"
        )
    return str(value)


def check_store_setting(options: Mapping[str, object]) -> bool:
    """The model option ``fp8_store_frozen`` of `options` (default False). Raises
    ``ValueError`` for a value other than a bool, or for True without a recipe in ``fp8``,
    naming the fix."""
    value = options.get("fp8_store_frozen", False)
    if not isinstance(value, bool):
        raise ValueError(f"option fp8_store_frozen={value!r} must be True or False")
    if value and check_setting(options.get("fp8")) is None:
        raise ValueError(
            "option fp8_store_frozen=True stores the weights of float8 linears; set option "
            "fp8 ('tensorwise' or 'rowwise') too, or drop it"
        )
    return value


def check_device(device: torch.device) -> None:
    """Raise ``ValueError`` unless ``torch._scaled_mm`` runs on `device`: a CUDA device of compute
    capability >= 8.9, or a device whose torch build has a (reference) kernel for it, as torch's
    CPU build does; the fix named is to leave ``fp8`` off there."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        if (major, minor) < (8, 9):
            name = torch.cuda.get_device_name(index)
            raise ValueError(
                f"option fp8 needs float8 tensor cores (compute capability >= 8.9: Ada, Hopper "
                f"or later); {name} is {major}.{minor}. Leave fp8 off on this GPU"
            )
        return
    a = torch.zeros(ALIGN, ALIGN, device=device).to(E4M3)
    one = torch.ones((), device=device)
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as e:
        raise ValueError(
            f"option fp8: torch {torch.__version__} has no float8 scaled GEMM on {device.type} "
            f"({e}); train on a CUDA GPU of compute capability >= 8.9, or leave fp8 off"
        ) from e


def check_linear(name: str, out_features: int, in_features: int, where: str = "") -> None:
    """Raise ``ValueError`` unless both dimensions of the linear `name` (its weight is
    ``[out_features, in_features]`` on this rank; `where` says how it was split) are multiples
    of `ALIGN`, naming the module, the shape and the fix."""
    if out_features % ALIGN or in_features % ALIGN:
        raise ValueError(
            f"option fp8: linear {name} has a weight of shape [{out_features}, {in_features}]"
            f"{where}, but float8 GEMMs need both dimensions to be multiples of {ALIGN}; pick a "
            "model (or tensor-parallel size) whose projections are, or leave fp8 off"
        )


def quantise(t: Tensor, dtype: torch.dtype, rowwise: bool) -> tuple[Tensor, Tensor]:
    """`t` ``[rows, cols]`` as float8 `dtype` and the float32 scale that undoes it: ``(q, s)``
    with ``q * s ≈ t``.

    `rowwise`: one scale per row, ``s`` ``[rows, 1]``; else one for the tensor, ``s`` ``[]``.
    Each scale is the power of two that brings the row's (tensor's) absolute maximum into
    ``(max / 2, max]`` of `dtype` (the rescaling is exact, only the cast rounds); values
    saturate at the format's maximum.
    """
    amax = t.abs().amax(dim=1, keepdim=True) if rowwise else t.abs().amax()
    fmax = torch.finfo(dtype).max
    up = torch.exp2(torch.floor(torch.log2(fmax / amax.float().clamp(min=_AMAX_FLOOR))))
    q = (t.float() * up).clamp(-fmax, fmax).to(dtype).contiguous()
    return q, up.reciprocal()


def quantise_reference(t: Tensor, dtype: torch.dtype, rowwise: bool) -> Tensor:
    """What `quantise` makes of `t`, dequantised, in float64 (the tests' reference)."""
    q, s = quantise(t, dtype, rowwise)
    return q.double() * s.double()


def quantise_columns(t: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``quantise(t.T, dtype, rowwise=True)`` for `t` ``[rows, cols]``, bit for bit: ``q``
    ``[cols, rows]`` and ``s`` ``[cols, 1]``. Reducing over `t`'s rows where it lies, before the
    transpose, keeps the reduction's reads contiguous (the weight-gradient GEMM's operands are
    scaled per column of the activation and of the output gradient, over every token)."""
    amax = t.abs().amax(dim=0)  # [cols]
    fmax = torch.finfo(dtype).max
    up = torch.exp2(torch.floor(torch.log2(fmax / amax.float().clamp(min=_AMAX_FLOOR))))
    q = (t.float() * up).clamp(-fmax, fmax).to(dtype)
    return q.t().contiguous(), up.reciprocal().unsqueeze(1)


def _gemm(
    aq: Tensor, sa: Tensor, bq_t: Tensor, sb: Tensor, out_dtype: torch.dtype, fast: bool = False
) -> Tensor:
    """``(aq * sa) @ (bq_t * sb).T`` on the scaled GEMM: `aq` ``[m, k]`` and `bq_t` ``[n, k]``
    float8 (row-major), `sa` ``[m, 1]`` / ``[]`` and `sb` ``[n, 1]`` / ``[]``; ``[m, n]`` in
    `out_dtype`. `fast`: Hopper's faster fp8 accumulation, which keeps fewer bits; as torchao
    does, only the forward GEMM takes it, gradients accumulate in full float32."""
    return torch._scaled_mm(
        aq,
        bq_t.t(),  # column-major [k, n], as the GEMM needs its second operand
        scale_a=sa,
        scale_b=sb.t(),
        out_dtype=out_dtype,
        use_fast_accum=fast,
    )


def _pad_cols(q: Tensor) -> Tensor:
    """Float8 `q` ``[rows, cols]`` with zero columns appended up to a multiple of `ALIGN` (padded
    as bytes: float8 has no pad kernel, and 0x00 is +0.0 in both formats)."""
    extra = -q.shape[1] % ALIGN
    if not extra:
        return q
    return torch.nn.functional.pad(q.view(torch.uint8), (0, extra)).view(q.dtype)


class _FP8Matmul(torch.autograd.Function):
    """``x @ w.T`` with float8 operands in all three GEMMs (see the module docstring).

    Tensorwise, an operand's quantisation does not depend on which dimension a GEMM contracts,
    so forward's quantised ``x`` and ``w`` are saved and reused (transposed) in backward, which
    quantises only the output gradient. Rowwise, the weight-gradient GEMM contracts over tokens,
    so it quantises ``x`` and the gradient again per column, and the input-gradient GEMM ``w``
    per input feature: backward keeps ``x`` and ``w`` in the compute dtype. Either way backward
    keeps only what its gradients need: no input for a frozen weight (a LoRA base)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, recipe: str) -> Tensor:  # [m, k], [n, k] -> [m, n]
        rowwise = recipe == "rowwise"
        xq, sx = quantise(x, E4M3, rowwise)
        wq, sw = quantise(w, E4M3, rowwise)
        ctx.rowwise, ctx.dtypes = rowwise, (x.dtype, w.dtype)
        # The input gradient needs the weight, the weight gradient the input: a frozen weight
        # (a LoRA base) keeps no input for backward.
        kept_x, kept_w = ((x, None), (w, None)) if rowwise else ((xq, sx), (wq, sw))
        need_x, need_w = ctx.needs_input_grad[:2]
        nothing = (None, None)
        ctx.save_for_backward(*(kept_x if need_w else nothing), *(kept_w if need_x else nothing))
        return _gemm(xq, sx, wq, sw, x.dtype, fast=True)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x_dtype, w_dtype = ctx.dtypes
        grad = grad.contiguous()  # [m, n]
        grad_x = grad_w = None
        x, sx, w, sw = ctx.saved_tensors  # float8 and scales tensorwise, the inputs rowwise
        if ctx.rowwise:
            if ctx.needs_input_grad[0]:  # [m, n] @ [n, k]: contracted over output features
                gq, sg = quantise(grad, E4M3, rowwise=True)
                wq_t, sw_t = quantise_columns(w, E4M3)
                grad_x = _gemm(gq, sg, wq_t, sw_t, x_dtype)
            if ctx.needs_input_grad[1]:  # [n, m] @ [m, k]: contracted over tokens
                gq_t, sg_t = quantise_columns(grad, E4M3)
                xq_t, sx_t = quantise_columns(x, E4M3)
                grad_w = _gemm(_pad_cols(gq_t), sg_t, _pad_cols(xq_t), sx_t, w_dtype)
            return grad_x, grad_w, None
        gq, sg = quantise(grad, E5M2, rowwise=False)
        if ctx.needs_input_grad[0]:
            grad_x = _gemm(gq, sg, w.t().contiguous(), sw, x_dtype)
        if ctx.needs_input_grad[1]:
            gq_t, xq_t = _pad_cols(gq.t().contiguous()), _pad_cols(x.t().contiguous())
            grad_w = _gemm(gq_t, sg, xq_t, sx, w_dtype)
        return grad_x, grad_w, None


class _StoredFP8Matmul(torch.autograd.Function):
    """``x @ (wq * sw).T`` for a frozen weight stored in float8 (`store_weight`): forward
    quantises only ``x``, backward only the output gradient, and backward keeps nothing but the
    stored weight. Under ``"tensorwise"`` every GEMM is bit for bit `_FP8Matmul`'s with that
    weight frozen (its quantisation of the weight is the stored one)."""

    @staticmethod
    def forward(ctx, x: Tensor, wq: Tensor, sw: Tensor, recipe: str) -> Tensor:
        rowwise = recipe == "rowwise"
        xq, sx = quantise(x, E4M3, rowwise)  # [m, k]
        ctx.rowwise, ctx.x_dtype = rowwise, x.dtype
        ctx.save_for_backward(wq, sw)
        return _gemm(xq, sx, wq, _scale_of_rows(sw, wq.shape[0], rowwise), x.dtype, fast=True)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        wq, sw = ctx.saved_tensors
        grad = grad.contiguous()  # [m, n]
        gq, sg = quantise(grad, E4M3 if ctx.rowwise else E5M2, ctx.rowwise)
        wq_t = wq.t().contiguous()  # [k, n]: the GEMM contracts over output features
        sw_t = _scale_of_rows(sw, wq_t.shape[0], ctx.rowwise)
        return _gemm(gq, sg, wq_t, sw_t, ctx.x_dtype), None, None, None


def _scale_of_rows(s: Tensor, rows: int, rowwise: bool) -> Tensor:
    """A tensorwise scale `s` ``[]`` as the GEMM takes it: ``[rows, 1]`` (every row's the same)
    when its other operand is scaled per row, else as it is."""
    return s.reshape(1, 1).expand(rows, 1).contiguous() if rowwise else s


def store_weight(w: Tensor) -> tuple[Tensor, Tensor]:
    """A frozen weight `w` ``[out, in]`` as stored in float8: ``(wq, s)``, `wq` e4m3 ``[out, in]``
    and `s` ``[]`` the float32 power-of-two scale with ``wq * s ≈ w`` (the tensorwise recipe's
    quantisation of `w`, bit for bit)."""
    return quantise(w, E4M3, rowwise=False)


def dequantise(wq: Tensor, s: Tensor) -> Tensor:
    """The float32 values of a weight `store_weight` stored: ``wq * s``, exact (a float8 value
    times a power of two is a float32 value), so ``store_weight(dequantise(wq, s))`` is
    ``(wq, s)`` again."""
    return wq.float() * s


def fp8_matmul(x: Tensor, w: Tensor, recipe: str, w_scale: Tensor | None = None) -> Tensor:
    """``x @ w.T`` for `x` ``[..., in]`` and `w` ``[out, in]`` (same floating dtype) with float8
    GEMMs in forward and backward under `recipe` (one of `RECIPES`); returns ``[..., out]`` in
    `x`'s dtype, gradients in `x`'s and `w`'s. A `w` stored in float8 (`store_weight`) comes
    with its scale `w_scale` and gets no gradient.

    Raises ``ValueError`` for an unknown recipe, or a float8 `w` without `w_scale` (or a
    `w_scale` for another `w`)."""
    if recipe not in RECIPES:
        raise ValueError(f"fp8 recipe {recipe!r} is not one of {', '.join(map(repr, RECIPES))}")
    if (w_scale is not None) != (w.dtype == E4M3):
        raise ValueError(
            f"fp8_matmul: a weight of dtype {w.dtype} with w_scale={w_scale is not None}; a "
            "weight stored in float8 (store_weight) needs its scale, any other none"
        )
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # [tokens, in]
    if w_scale is None:
        out = _FP8Matmul.apply(x2, w, recipe)
    else:
        out = _StoredFP8Matmul.apply(x2, w, w_scale, recipe)
    return out.reshape(*x.shape[:-1], w.shape[0])


def fp8_linear(
    x: Tensor, w: Tensor, bias: Tensor | None, recipe: str, w_scale: Tensor | None = None
) -> Tensor:
    """``F.linear(x, w, bias)`` with `fp8_matmul` (see there, and for `w_scale`; the bias is
    added in the compute dtype). Under autocast the operands are cast to the autocast dtype
    first, as autocast casts a linear's (a weight stored in float8 stays as it is); `x`
    ``[..., in]``, `w` ``[out, in]``, `bias` ``[out]`` -> ``[..., out]``."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        dtype = torch.get_autocast_dtype(kind)
        x = x.to(dtype)
        w = w if w_scale is not None else w.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        with torch.autocast(kind, enabled=False):
            return fp8_linear(x, w, bias, recipe, w_scale)
    out = fp8_matmul(x, w, recipe, w_scale)
    return out if bias is None else out + bias
