"""Layer specs for ``GPTModel``: megatron-core's own modules with torch SDPA as core attention.

This spec keeps megatron-core's parallel linears, MLP and MoE layers and swaps in:

- `twinkle_fn.backends.megatron.attention.SDPAAttention` as core attention (megatron-core's local spec
  computes an unfused ``[seq, seq]`` matrix);
- `RMSNorm`: an RMSNorm whose weight carries megatron's ``sequence_parallel`` flag, so that
  ``finalize_model_grads`` all-reduces its gradient over the tensor-parallel group under SP
  (megatron's torch norms refuse sequence parallelism); torch.compile'd when
  ``config.persist_layer_norm`` (the default with CUDA);
- `RowParallelLinear`: megatron-core's, handing its matmul its tensor-parallel group;
- `SelfAttention`: megatron-core's, leaving a packed row's rotary embedding to the core
  attention when the row carries each token's angles (`twinkle_fn.backends.megatron.packed_rotary`);
- `GroupedSequentialMLP` as MoE experts (unless ``grouped_experts=False``): ``SequentialMLP``'s
  parameters, run as two grouped GEMMs (`twinkle_fn.backends.megatron.grouped_experts`).

With TransformerEngine importable, `layer_spec` uses TE's modules instead, laid out the same way
(separate norms, no fused norm-linear) so that parameter names are identical across backends:
``input_layernorm.weight``, ``self_attention.linear_qkv.weight``, ``mlp.linear_fc1.weight``...
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
from megatron.core.transformer import attention as mcore_attention
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)
from torch import Tensor

from twinkle_fn.backends.megatron import mla
from twinkle_fn.backends.megatron.attention import SDPAAttention
from twinkle_fn.backends.megatron.gated_delta_net import GatedDeltaNet, eager
from twinkle_fn.backends.megatron.grouped_experts import GroupedSequentialMLP
from twinkle_fn.backends.megatron.packed_rotary import rotary_freqs


def have_te() -> bool:
    """Whether TransformerEngine is importable (megatron-core's own detection)."""
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return bool(HAVE_TE)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight * x / rms(x)`` over the last dim of `x` ``[..., hidden]``, like HF's Llama/Qwen.

    Normalised in float32, rounded to x's dtype, then scaled by `weight` ``[hidden]``.
    """
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


def rms_norm_offset(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``(1 + weight) * x / rms(x)`` over the last dim of `x` ``[..., hidden]``, like HF's
    Qwen3.5 / Gemma norms (weights centred on 0): scaled in float32, then rounded to x's dtype.
    """
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


@functools.cache
def _compiled_rms_norm(offset: bool = False) -> Callable[[Tensor, Tensor, float], Tensor]:
    """`rms_norm` (`rms_norm_offset` if `offset`) compiled into one forward and one backward
    kernel (compiled on first call).

    Every norm in the process shares this function, and each new dtype, eps, grad mode or
    ``requires_grad`` of its inputs compiles it again: one process holding several models (an
    actor, a reference, a critic; a test session) can pass dynamo's recompile limit (8). Without
    ``fullgraph=True`` a call past the limit runs the eager norm (same values) instead of
    raising ``FailOnRecompileLimitHit``; the function has no graph break to guard against."""
    return torch.compile(rms_norm_offset if offset else rms_norm)


class RMSNorm(torch.nn.Module):
    """RMSNorm over the last dimension, computed in float32 like HF's Llama/Qwen norms.

    ``weight`` (ones at init, ``config.params_dtype``) is marked ``sequence_parallel`` when the
    config is, so megatron sums its gradient over the tensor-parallel group. With
    ``config.persist_layer_norm`` (megatron's switch for its fused norm kernel; on by default
    with CUDA, see `twinkle_fn.backends.megatron.config`) `rms_norm` runs torch.compile'd: the unfused
    form is ~4 passes over the activations forward and ~6 backward. With `zero_centered` (default
    ``config.layernorm_zero_centered_gamma``) it scales by ``1 + weight`` (`rms_norm_offset`;
    ``weight`` zeros at init). Raises ``ValueError`` if ``config.normalization`` is not
    ``"RMSNorm"``.
    """

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-6,
        zero_centered: bool | None = None,
    ) -> None:
        super().__init__()
        if config.normalization != "RMSNorm":
            raise ValueError(
                f"RMSNorm built for normalization={config.normalization!r}; "
                "set TransformerConfig.normalization='RMSNorm'"
            )
        self.eps = eps
        if zero_centered is None:
            zero_centered = config.layernorm_zero_centered_gamma
        self.zero_centered = bool(zero_centered)
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(
            init(hidden_size, dtype=config.params_dtype, device=_init_device(config))
        )
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        self.fused = bool(config.persist_layer_norm)

    def forward(self, x: Tensor) -> Tensor:
        """``weight * x / rms(x)`` (``(1 + weight)`` when zero-centred) over the last dim; `x`:
        ``[..., hidden]``."""
        if self.fused:
            norm = _compiled_rms_norm(self.zero_centered)
        else:
            norm = rms_norm_offset if self.zero_centered else rms_norm
        return norm(x, self.weight, self.eps)


class HeadRMSNorm(RMSNorm):
    """A plain (``weight``, ones at init) RMSNorm over each head's channels inside a
    tensor-parallel layer (a Gated DeltaNet's gated output norm): each tp rank normalises its
    own heads with the one replicated ``weight``, whose gradient is therefore summed over the
    tp group in backward (megatron's ``finalize_model_grads`` sums the q/k norms' by name only).
    Its weight is never marked ``sequence_parallel``: the heads, not the sequence, are split."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(config, hidden_size, eps, zero_centered=False)
        self.weight.sequence_parallel = False  # type: ignore[attr-defined]
        self.tp = config.tensor_model_parallel_size

    def forward(self, x: Tensor) -> Tensor:
        """``weight * x / rms(x)`` over the last dim; `x`: ``[..., head_dim]``."""
        weight = self.weight
        if self.tp > 1:
            weight = tensor_parallel.copy_to_tensor_model_parallel_region(weight)
        norm = _compiled_rms_norm() if self.fused else rms_norm
        return norm(x, weight, self.eps)


def _init_device(config: TransformerConfig) -> torch.device:
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class RowParallelLinear(tensor_parallel.RowParallelLinear):
    """megatron-core's ``RowParallelLinear``, handing its matmul its own tensor-parallel group.

    megatron-core 0.19 passes ``tp_group=None`` to that call (it communicates nothing there: the
    all-reduce follows it), which then looks the default group up and issues a
    ``DeprecationWarning`` on rank 0 in every forward: host work per layer, and a graph break
    under ``torch.compile``.
    """

    def _forward_impl(self, input: Tensor, weight: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if kwargs.get("tp_group") is None:
            kwargs["tp_group"] = self.tp_group
        return super()._forward_impl(input, weight, *args, **kwargs)


class SelfAttention(mcore_attention.SelfAttention):
    """megatron-core's ``SelfAttention``; a packed row whose ``packed_seq_params`` carry each
    token's rotary angles (`twinkle_fn.backends.megatron.packed_rotary.with_rotary`) is not rotated
    here but by `SDPAAttention`, in one pass. megatron-core rotates packed rows sample by
    sample at boundaries it reads on the host, in every layer."""

    def forward(self, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        """megatron's ``SelfAttention.forward``; `kwargs` as ``TransformerLayer`` passes them."""
        if rotary_freqs(kwargs.get("packed_seq_params")) is not None:
            kwargs["rotary_pos_emb"] = None
        return super().forward(*args, **kwargs)

    def _apply_output_gate(self, x: Tensor, gate: Tensor) -> Tensor:
        # megatron's jit_fuser compiles it: only with twinkle's compiled kernels (CUDA), as
        # for the Gated DeltaNet's helpers
        method = mcore_attention.SelfAttention._apply_output_gate
        fused = self.config.bias_activation_fusion
        return (method if fused else eager(method))(self, x, gate)


class _SDPASpecProvider(LocalSpecProvider):
    """megatron-core's local modules, with `SDPAAttention`, `RMSNorm` and `RowParallelLinear`;
    MoE experts are `GroupedSequentialMLP` when `grouped_experts`, else ``SequentialMLP``."""

    def __init__(self, grouped_experts: bool = True) -> None:
        super().__init__()
        self.grouped_experts = grouped_experts

    def row_parallel_linear(self) -> type[RowParallelLinear]:
        return RowParallelLinear

    def layer_norm(
        self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False
    ) -> type[RMSNorm]:
        return RMSNorm

    def core_attention(self) -> type[SDPAAttention]:
        return SDPAAttention

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool) -> functools.partial:
        sequential = super().grouped_mlp_modules(moe_use_grouped_gemm)
        if not self.grouped_experts:
            return sequential
        return functools.partial(GroupedSequentialMLP, *sequential.args, **sequential.keywords)


def _backend(use_te: bool | None, grouped_experts: bool = True) -> BackendSpecProvider:
    te = have_te()
    if use_te and not te:
        raise ValueError(
            "use_te=True but TransformerEngine is not importable; install transformer_engine "
            "or use use_te=None/False for the SDPA spec"
        )
    if te if use_te is None else use_te:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        return TESpecProvider()
    return _SDPASpecProvider(grouped_experts)


def layer_spec(
    config: TransformerConfig,
    use_te: bool | None = None,
    *,
    moe: bool | None = None,
    grouped_experts: bool = True,
    linear: bool = False,
) -> ModuleSpec:
    """``ModuleSpec`` of one ``TransformerLayer`` (norm -> attention -> norm -> MLP or MoE).

    `use_te`: TransformerEngine's modules (None: when importable) or megatron-core's with
    `SDPAAttention` and `RMSNorm`, never fused norm-linears, so parameter names are the local
    spec's on both (experts: with ``moe_grouped_gemm=False``). `moe`: an MoE layer (default:
    iff the config has experts). `grouped_experts`: the SDPA spec's experts run as grouped
    GEMMs (`GroupedSequentialMLP`), else in megatron's loop (``SequentialMLP``); same
    parameters either way. q/k RMSNorms when ``config.qk_layernorm``; multi-latent attention
    (`twinkle_fn.backends.megatron.mla`) when ``config.multi_latent_attention``. `linear`: a
    Gated DeltaNet layer (`_gated_delta_net` in the attention's place). Raises ``ValueError``
    for ``use_te=True`` without TransformerEngine.
    """
    backend = _backend(use_te, grouped_experts)
    is_moe = config.num_moe_experts is not None if moe is None else moe
    norm = backend.layer_norm(rms_norm=True, for_qk=False)
    qk_norm = backend.layer_norm(rms_norm=True, for_qk=True) if config.qk_layernorm else IdentityOp
    attention = (
        _gated_delta_net(backend)
        if linear
        else ModuleSpec(
            # TE's core attention does not apply `packed_rotary` angles: megatron rotates there
            module=SelfAttention
            if isinstance(backend, _SDPASpecProvider)
            else mcore_attention.SelfAttention,
            params={"attn_mask_type": AttnMaskType.causal},
            submodules=SelfAttentionSubmodules(
                linear_qkv=backend.column_parallel_linear(),
                core_attention=backend.core_attention(),
                linear_proj=backend.row_parallel_linear(),
                q_layernorm=qk_norm,
                k_layernorm=qk_norm,
            ),
        )
    )
    if config.multi_latent_attention:
        attention = mla.attention_spec(backend, backend.layer_norm(rms_norm=True, for_qk=True))
    if is_moe:
        mlp = get_moe_module_spec_for_backend(
            backend=backend,
            num_experts=config.num_moe_experts,
            moe_grouped_gemm=config.moe_grouped_gemm,
        )
    else:
        # Plain column/row linears even where the backend offers a fused norm + fc1: the
        # pre-MLP norm stays its own module (and parameter name) on every backend.
        mlp = functools.partial(
            MLP.as_mlp_submodule,
            submodules=MLPSubmodules(
                linear_fc1=backend.column_parallel_linear(),
                linear_fc2=backend.row_parallel_linear(),
            ),
        )
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=attention,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


def _gated_delta_net(backend: BackendSpecProvider) -> ModuleSpec:
    """megatron-core's ``GatedDeltaNet`` as a layer's attention, with the layer's own input
    norm (not fused into ``in_proj``: parameter names stay those of every layer) and a plain
    (not zero-centred) RMSNorm as its gated output norm (`HeadRMSNorm`), as HF's Qwen3.5 has;
    fla's kernels or
    their torch fallbacks (`twinkle_fn.backends.megatron.gated_delta_net`)."""
    return ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=backend.column_parallel_linear(),
            out_norm=HeadRMSNorm,
            out_proj=backend.row_parallel_linear(),
        ),
    )


def linear_attention_pattern(config: TransformerConfig) -> list[bool]:
    """Per global layer, whether it is a Gated DeltaNet layer (``config.linear_attention_freq``
    as a list; none without the ``gated_delta_net`` attention variant)."""
    if config.experimental_attention_variant != "gated_delta_net":
        return [False] * config.num_layers
    return [bool(f) for f in config.linear_attention_freq]


def moe_layer_pattern(config: TransformerConfig) -> list[bool]:
    """Per global layer, whether it is an MoE layer (from ``config.moe_layer_freq``)."""
    if config.num_moe_experts is None:
        return [False] * config.num_layers
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(config.num_layers)]
    return [bool(f) for f in freq]


def decoder_spec(
    config: TransformerConfig,
    use_te: bool | None = None,
    *,
    pp_rank: int | None = None,
    grouped_experts: bool = True,
) -> TransformerBlockSubmodules:
    """Block spec of this pipeline stage's layers (dense or MoE each; a Gated DeltaNet or
    attention each, `linear_attention_pattern`) and the final norm.

    `pp_rank` defaults to megatron's current pipeline rank; `use_te` and `grouped_experts` as
    `layer_spec` takes them, but a model with Gated DeltaNet layers always takes the SDPA spec
    (``use_te=None`` too). Raises like `layer_spec`, and ``ValueError`` for ``use_te=True``
    with Gated DeltaNet layers.
    """
    pattern = moe_layer_pattern(config)
    linear = linear_attention_pattern(config)
    if any(linear):
        if use_te:
            raise ValueError(
                "use_te=True: twinkle's TransformerEngine spec does not build Gated DeltaNet "
                "layers; use use_te=None or False"
            )
        use_te = False
    offset = get_transformer_layer_offset(config, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, pp_rank=pp_rank)
    stage = slice(offset, offset + count)
    return TransformerBlockSubmodules(
        layer_specs=[
            layer_spec(config, use_te, moe=m, grouped_experts=grouped_experts, linear=la)
            for m, la in zip(pattern[stage], linear[stage], strict=True)
        ],
        layer_norm=_backend(use_te).layer_norm(rms_norm=True, for_qk=False),
    )
