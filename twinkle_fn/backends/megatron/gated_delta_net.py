"""megatron-core's Gated DeltaNet without flash-linear-attention: torch kernels in fla's places.

megatron-core 0.19's ``GatedDeltaNet`` (``megatron.core.ssm.gated_delta_net``) imports three
kernels from fla (flash-linear-attention) and refuses to build without it: ``causal_conv1d``
(the depthwise causal convolution over q/k/v), ``l2norm`` (of each query and key head) and
``chunk_gated_delta_rule`` (the recurrence). fla is not a dependency of twinkle (it is neither
on the CPU machines nor on the GPU ones), so `use_kernels` puts torch versions of the three
into megatron's module namespaces when fla is not importable, the way
`twinkle_fn.backends.megatron.cpu_compat` puts CPU stand-ins in place of CUDA calls; with fla
importable megatron's own imports stand and nothing is replaced. The torch versions run on any
device (CPU and CUDA) and take fla's arguments, ``cu_seqlens`` included: a packed row's samples
(``cu_seqlens`` boundaries, batch 1) are laid out as rows of a padded batch, so that neither the
convolution nor the recurrence reads across a boundary, and put back.

The recurrence is megatron's own ``torch_chunk_gated_delta_rule`` (chunks of 64 tokens, the
chunk's triangular system solved by forward substitution), which transformers' torch path for
Qwen3.5 also computes (its triangular system solved by ``solve_triangular``): the two agree to
float32 rounding (`gated_delta_net_test`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.ssm.gated_delta_net import common, gdn
from torch import Tensor
from transformers import PretrainedConfig

from twinkle_fn.mesh import Mesh
from twinkle_fn.models.families import Family

# fla's default epsilon of l2norm (transformers' torch path uses the same).
L2NORM_EPS = 1e-6
_ACTIVATIONS = (None, "silu", "swish")


def l2norm(x: Tensor, dim: int = -1, eps: float = L2NORM_EPS) -> Tensor:
    """`x` divided by its L2 norm over `dim`: ``x * rsqrt(sum(x^2) + eps)``, in float32, returned
    in x's dtype (fla's ``l2norm``; transformers' torch Qwen3.5 path computes the same)."""
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).sum(dim=dim, keepdim=True) + eps)).to(x.dtype)


def _unpack(x: Tensor, bounds: list[int]) -> Tensor:
    """A packed ``[1, T, ...]`` as ``[samples, longest, ...]``, each sample a row, zero-padded
    at its end."""
    rows = [x[0, a:b] for a, b in itertools.pairwise(bounds)]
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)


def _repack(x: Tensor, bounds: list[int]) -> Tensor:
    """The inverse of `_unpack`: ``[samples, longest, ...]`` -> ``[1, T, ...]``."""
    lengths = (b - a for a, b in itertools.pairwise(bounds))
    return torch.cat([x[i, :n] for i, n in enumerate(lengths)])[None]


def _bounds(cu_seqlens: Tensor, batch: int, tokens: int, what: str) -> list[int]:
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if batch != 1 or bounds[0] != 0 or bounds[-1] != tokens or len(bounds) < 2:
        raise ValueError(
            f"{what}: cu_seqlens {bounds} must run from 0 to the row's {tokens} tokens, with a "
            f"batch of 1 packed row (got batch {batch})"
        )
    return bounds


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    activation: str | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    **kwargs: object,
) -> tuple[Tensor, None]:
    """Depthwise causal convolution over the sequence, fla's ``causal_conv1d`` in torch.

    `x` ``[batch, seq, channels]``, `weight` ``[channels, width]``, `bias` ``[channels]`` or
    None; `activation` None or ``"silu"``/``"swish"``. Output ``[batch, seq, channels]`` in x's
    dtype (the final state is not kept: None). With `cu_seqlens` (``[samples + 1]``, batch 1)
    each packed sample is convolved alone. Raises ``ValueError`` for another activation, an
    initial or final state (inference only; not implemented), or `cu_seqlens` that do not
    cover the row.
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(f"causal_conv1d activation {activation!r} is not one of {_ACTIVATIONS}")
    if initial_state is not None or output_final_state:
        raise ValueError(
            "causal_conv1d's torch fallback keeps no convolution state (initial_state / "
            "output_final_state, used for cached decoding); install fla for that"
        )
    if cu_seqlens is not None:
        bounds = _bounds(cu_seqlens, x.shape[0], x.shape[1], "causal_conv1d")
        out, _ = causal_conv1d(_unpack(x, bounds), weight, bias, activation)
        return _repack(out, bounds), None
    channels, width = weight.shape
    out = F.conv1d(
        x.transpose(1, 2).to(weight.dtype),
        weight[:, None],
        bias,
        padding=width - 1,
        groups=channels,
    )[..., : x.shape[1]]
    if activation is not None:
        out = F.silu(out)
    return out.transpose(1, 2).to(x.dtype), None


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Tensor | None = None,
    **kwargs: object,
) -> tuple[Tensor, Tensor | None]:
    """The gated delta rule over chunks, fla's ``chunk_gated_delta_rule`` in torch (megatron's
    ``torch_chunk_gated_delta_rule``, computed in float32).

    `q`, `k` ``[batch, seq, heads, k_dim]``, `v` ``[batch, seq, heads, v_dim]``, `g` (log
    decay) and `beta` ``[batch, seq, heads]``; `scale` multiplies the queries (default
    ``k_dim ** -0.5``). Output ``[batch, seq, heads, v_dim]`` in q's dtype, and the final
    state ``[batch, heads, k_dim, v_dim]`` when `output_final_state`. With `cu_seqlens`
    (``[samples + 1]``, batch 1) each packed sample runs from a zero state. Raises
    ``ValueError`` for a state together with `cu_seqlens` or `cu_seqlens` that do not cover
    the row.
    """
    if scale is not None:
        q = q * (scale * q.shape[-1] ** 0.5)  # megatron's kernel scales by k_dim ** -0.5
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if cu_seqlens is not None:
        if initial_state is not None or output_final_state:
            raise ValueError(
                "chunk_gated_delta_rule's torch fallback takes no recurrent state with "
                "cu_seqlens (packed rows start from zero; states are for cached decoding)"
            )
        bounds = _bounds(cu_seqlens, q.shape[0], q.shape[1], "chunk_gated_delta_rule")
        rows = (_unpack(t, bounds) for t in (q, k, v, g, beta))
        out, _ = common.torch_chunk_gated_delta_rule(*rows)
        return _repack(out, bounds), None
    return common.torch_chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state
    )


def use_kernels() -> str:
    """Make megatron-core's ``GatedDeltaNet`` buildable: ``"fla"`` when fla is importable
    (megatron's own imports are kept), else ``"torch"`` after putting `causal_conv1d`,
    `l2norm` and `chunk_gated_delta_rule` where megatron looks them up. Idempotent; call it
    before building a model with Gated DeltaNet layers."""
    if common.chunk_gated_delta_rule is chunk_gated_delta_rule:
        return "torch"
    if common.HAVE_FLA:
        return "fla"
    for module in (common, gdn):
        module.causal_conv1d = causal_conv1d
        module.chunk_gated_delta_rule = chunk_gated_delta_rule
    common.l2norm = l2norm
    common.HAVE_FLA = True  # read by GatedDeltaNet.__init__ only
    return "torch"


_SIZES = (
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
)


def config_fields(hf_config: PretrainedConfig, row: Family, mesh: Mesh) -> dict[str, Any]:
    """The ``TransformerConfig`` fields of `row`'s Gated DeltaNet layers (`row.linear_attention`)
    under `hf_config` on `mesh`: megatron's ``gated_delta_net`` attention variant on the layers
    of the row's rule (``linear_attention_freq``, 1 for a DeltaNet layer) and the DeltaNet's
    sizes (the HF config's fields of the same names). Raises ``ValueError`` when tp does not
    divide the DeltaNet's key or value heads (megatron splits whole heads), or for cp > 1
    (untested here)."""
    linear = set(row.linear_attention.layers(hf_config))
    sizes = {name: getattr(hf_config, name) for name in _SIZES}
    for field in ("linear_num_key_heads", "linear_num_value_heads"):
        if sizes[field] % mesh.tp:
            raise ValueError(
                f"tp={mesh.tp} does not divide {field}={sizes[field]} of this model's Gated "
                f"DeltaNet layers (megatron splits whole heads); use a tp that divides it"
            )
    if mesh.cp > 1:
        raise ValueError(
            f"cp={mesh.cp}: context parallelism of Gated DeltaNet layers (megatron's all-to-all "
            "over heads) is not supported by twinkle's megatron backend; use cp=1"
        )
    return dict(
        sizes,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[int(i in linear) for i in range(hf_config.num_hidden_layers)],
    )


def eager(method: Callable[..., Any]) -> Callable[..., Any]:
    """The function megatron's ``jit_fuser`` (``torch.compile``) wrapped, or `method` itself."""
    return getattr(method, "_torchdynamo_orig_callable", method)


class GatedDeltaNet(gdn.GatedDeltaNet):
    """megatron-core's ``GatedDeltaNet``, whose ``torch.compile``'d helpers (megatron's
    ``jit_fuser``: the gated norm, the q/k/v preparation, the decay) run compiled only with
    ``config.bias_activation_fusion`` (twinkle's switch for megatron's compiled kernels, on
    with CUDA): compiling them for the CPU takes ~20 s per model and saves nothing there.
    Built like megatron's (same arguments, same parameters)."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        use_kernels()
        super().__init__(config, *args, **kwargs)
        self._fused = bool(config.bias_activation_fusion)

    def _apply_gated_norm(self, x: Tensor, gate: Tensor) -> Tensor:
        return _helper(self, "_apply_gated_norm")(self, x, gate)

    def _prepare_input_for_gated_delta_rule(self, *args: Any) -> tuple[Tensor, ...]:
        return _helper(self, "_prepare_input_for_gated_delta_rule")(self, *args)

    def _compute_g_and_beta(self, *args: Any) -> tuple[Tensor, Tensor]:
        return _helper(self, "_compute_g_and_beta")(self, *args)


def _helper(module: GatedDeltaNet, name: str) -> Callable[..., Any]:
    method = getattr(gdn.GatedDeltaNet, name)
    return method if module._fused else eager(method)
