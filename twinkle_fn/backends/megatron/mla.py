"""Multi-latent attention (DeepSeek-V2/V3) on megatron-core's own ``MLASelfAttention``.

A family row with `Family.latent_attention` is built on ``GPTModel`` with
``MLATransformerConfig`` (`mla_fields`) and `attention_spec`, which lays megatron's MLA out as
HF's ``DeepseekV3Attention`` computes it:

=====================================  ==============================  ======================
HF (``self_attn.``)                    megatron (``self_attention.``)  tensor parallelism
=====================================  ==============================  ======================
q_a_proj                               linear_q_down_proj              rows split, gathered
q_a_layernorm                          q_layernorm                     replicated
q_b_proj (q_proj without q_lora_rank)  linear_q_up_proj (linear_q_proj) by heads
kv_a_proj_with_mqa                     linear_kv_down_proj             rows split, gathered
kv_a_layernorm                         kv_layernorm                    replicated
kv_b_proj                              linear_kv_up_proj               by heads
o_proj                                 linear_proj                     row-parallel
=====================================  ==============================  ======================

The rotary part of each query and key is rotated in DeepSeek's interleaved pairs (megatron's
MLA always de-interleaves them as HF's ``rope_interleave=True`` does); the softmax scale is
``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``, times YaRN's ``mscale_all_dim`` factor
squared when ``rope_parameters`` are YaRN's. Everything megatron's MLA would compute otherwise
is refused up front, naming the config field (`check_supported`).

Why `MLASelfAttention` subclasses megatron's: its norms are HF's (a query norm only with a
query down projection, the latent norm always; megatron ties them to ``qk_layernorm`` and
fused norm-linears), and the rotary key's gradient. That key (the last
``qk_rope_head_dim`` outputs of ``kv_a_proj_with_mqa``) is one tensor read by every head, so
on a tp rank its gradient holds that rank's heads' part only. megatron-core's local spec
gathers the down projection's split output and its backward keeps each rank's slice of that
partial gradient: the key's rows would train on one rank's heads. Here the gathered output
is scattered back over the sequence under sequence parallelism (megatron's own MLA path then
reduce-scatters the key's gradient, summing the heads), and without it the key's gradient is
all-reduced over tp.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer import multi_latent_attention as mcore_mla
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import get_pg_size
from torch import Tensor
from transformers import PretrainedConfig

from twinkle_fn.backends.megatron.bridge_rules import mla_split_rows
from twinkle_fn.mesh import Mesh

# HF rope types megatron's MLA computes: plain rotary, and YaRN (megatron's YarnRotaryEmbedding)
_ROPE_TYPES = {"default": "rope", "yarn": "yarn"}


def _rope_parameters(hf_config: PretrainedConfig) -> dict[str, Any]:
    """transformers 5's ``rope_parameters`` (4.x: ``rope_theta`` and ``rope_scaling``)."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is not None:
        return dict(params)
    scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    return {"rope_theta": getattr(hf_config, "rope_theta", 10000.0), **scaling}


def _yarn_fields(hf_config: PretrainedConfig, params: dict[str, Any]) -> dict[str, Any]:
    """megatron's YaRN settings equal to HF's ``_compute_yarn_parameters`` for `params`.

    Raises ``ValueError`` for what megatron's ``YarnRotaryEmbedding`` computes otherwise.
    """
    original = params.get("original_max_position_embeddings")
    factor = params.get("factor") or (
        hf_config.max_position_embeddings / original if original else None
    )
    if original is None or factor is None:
        raise ValueError(
            f"rope_parameters={params!r}: YaRN needs factor and original_max_position_embeddings"
        )
    if params.get("attention_factor") is not None:
        raise ValueError(
            f"rope_parameters attention_factor={params['attention_factor']!r} is not supported "
            "by megatron-core's MLA, which derives it from factor, mscale and mscale_all_dim; "
            "remove it or use backend='transformers'"
        )
    if params.get("truncate", True) is not True:
        raise ValueError(
            "rope_parameters truncate=False is not supported by megatron-core's MLA (it rounds "
            "YaRN's correction range to whole dims); remove it or use backend='transformers'"
        )
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if all_dim and not mscale:
        # HF then scales cos/sin by mscale(factor) alone, megatron by a ratio with all_dim
        raise ValueError(
            f"rope_parameters mscale_all_dim={all_dim!r} without mscale is not supported: "
            "megatron-core's MLA divides the rotary scale by mscale_all_dim's where HF does "
            "not; set mscale (DeepSeek-V3 uses mscale == mscale_all_dim) or use "
            "backend='transformers'"
        )
    return dict(
        rotary_scaling_factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        # HF scales cos/sin by mscale(factor) when either is unset: megatron's mscale=1 over
        # mscale_all_dim=0 is that ratio
        mscale=float(mscale) if mscale and all_dim else 1.0,
        mscale_all_dim=float(all_dim) if mscale and all_dim else 0.0,
    )


def check_supported(hf_config: PretrainedConfig) -> None:
    """Refuse a multi-latent attention config megatron-core's MLA computes differently from HF.

    Raises ``ValueError`` naming the field for ``rope_interleave=False`` (megatron's MLA always
    rotates interleaved pairs), a rope type other than default and YaRN, partial rotary, and
    YaRN settings megatron derives otherwise (see `_yarn_fields`).
    """
    if not getattr(hf_config, "rope_interleave", True):
        raise ValueError(
            "rope_interleave=False is not supported on the megatron backend: megatron-core's "
            "multi-latent attention always rotates neighbouring channel pairs (DeepSeek's "
            "layout); set rope_interleave=True or use backend='transformers'"
        )
    params = _rope_parameters(hf_config)
    kind = params.get("rope_type", "default")
    if kind not in _ROPE_TYPES:
        raise ValueError(
            f"rope_type={kind!r} is not supported with multi-latent attention on the megatron "
            f"backend; use one of {', '.join(_ROPE_TYPES)} or backend='transformers'"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"partial_rotary_factor={params['partial_rotary_factor']!r} is not supported with "
            "multi-latent attention (qk_rope_head_dim is its rotary part); remove it"
        )
    if kind == "yarn":
        _yarn_fields(hf_config, params)


def mla_fields(hf_config: PretrainedConfig, mesh: Mesh) -> dict[str, Any]:
    """The ``MLATransformerConfig`` fields of `hf_config`'s multi-latent attention on `mesh`.

    Raises ``ValueError`` as `check_supported`, and when tp does not divide the down
    projections' rows (``q_lora_rank``, ``kv_lora_rank + qk_rope_head_dim``).
    """
    check_supported(hf_config)
    for field, rows in mla_split_rows(hf_config):
        if rows % mesh.tp:
            raise ValueError(
                f"tp={mesh.tp} does not divide {field}={rows}, the rows of a down projection "
                "megatron-core splits over tensor parallelism; use a tp that divides it"
            )
    params = _rope_parameters(hf_config)
    kind = _ROPE_TYPES[params.get("rope_type", "default")]
    nope, rope = hf_config.qk_nope_head_dim, hf_config.qk_rope_head_dim
    rope_fields = (
        _yarn_fields(hf_config, params) if kind == "yarn" else {"rotary_scaling_factor": 1.0}
    )
    return dict(
        multi_latent_attention=True,
        q_lora_rank=hf_config.q_lora_rank,
        kv_lora_rank=hf_config.kv_lora_rank,
        qk_head_dim=nope,
        qk_pos_emb_head_dim=rope,
        v_head_dim=hf_config.v_head_dim,
        # every head has its own keys and values (expanded from the latent)
        num_query_groups=hf_config.num_attention_heads,
        kv_channels=nope + rope,
        # the latent norms are `MLASelfAttention`'s own; there are no per-head q/k norms
        qk_layernorm=False,
        # megatron's MLA interleaves through its own flag; this one is for rotate_half layouts
        rotary_interleaved=False,
        apply_rope_fusion=False,
        rope_type=kind,
        rotary_base=float(params["rope_theta"]),
        **rope_fields,
    )


class _SumOverTp(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient's channels ``[start:]`` over tp."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, start: int, group: Any) -> Tensor:
        ctx.start, ctx.group = start, group
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        grad = grad.clone()
        part = grad[..., ctx.start :].contiguous()
        torch.distributed.all_reduce(part, group=ctx.group)
        grad[..., ctx.start :] = part
        return grad, None, None


class MLASelfAttention(mcore_mla.MLASelfAttention):
    """megatron-core's ``MLASelfAttention`` with HF's latent norms and the rotary key's
    gradient summed over tensor-parallel ranks (see the module docstring).

    Takes what megatron's takes; ``hidden_states`` ``[seq, batch, hidden]`` (the sequence
    shard under sequence parallelism) -> ``([seq, batch, hidden], bias)``.
    """

    def _resolve_qk_norm_config(self, submodules: Any) -> dict[str, Any]:
        # HF: q_a_layernorm only with a query down projection, kv_a_layernorm always, and plain
        # up projections (megatron ties both norms to qk_layernorm and fuses them otherwise)
        norm = submodules.kv_layernorm
        with_q = self.config.q_lora_rank is not None
        return {
            "linear_q_proj": IdentityOp if with_q else submodules.linear_q_proj,
            "linear_q_up_proj": submodules.linear_q_up_proj if with_q else IdentityOp,
            "linear_kv_up_proj": submodules.linear_kv_up_proj,
            "q_layernorm": norm if with_q else IdentityOp,
            "kv_layernorm": norm,
        }

    def _qkv_down_projection(self, hidden_states: Tensor) -> tuple[Tensor, Tensor]:
        # q: [s, b, q_lora_rank] (s / tp under SP) or hidden_states; kv: [s, b, (kv + rope) / tp]
        q_compressed, kv_combined = super()._qkv_down_projection(hidden_states)
        if get_pg_size(self.tp_group) == 1:
            return q_compressed, kv_combined
        # [s, b, kv_lora_rank + rope], whole on every rank
        kv_combined = gather_from_tensor_model_parallel_region(kv_combined, group=self.tp_group)
        if self.config.sequence_parallel:
            # [s / tp, b, kv + rope]: megatron's MLA then gathers the rotary key over the
            # sequence, whose backward (reduce-scatter) sums every rank's heads' gradient
            return q_compressed, scatter_to_sequence_parallel_region(
                kv_combined, group=self.tp_group
            )
        rope_start = self.config.kv_lora_rank
        return q_compressed, _SumOverTp.apply(kv_combined, rope_start, self.tp_group)


def attention_spec(backend: Any, norm: Any) -> ModuleSpec:
    """The ``ModuleSpec`` of `MLASelfAttention` on `backend` (a megatron ``BackendSpecProvider``):
    its column-parallel linears for every projection but ``linear_proj`` (row-parallel), its
    core attention, and `norm` (an RMSNorm class) as both latent norms."""
    column = backend.column_parallel_linear()
    return ModuleSpec(
        module=MLASelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=mcore_mla.MLASelfAttentionSubmodules(
            linear_q_proj=column,
            linear_q_down_proj=column,
            linear_q_up_proj=column,
            linear_kv_down_proj=column,
            linear_kv_up_proj=column,
            core_attention=backend.core_attention(),
            linear_proj=backend.row_parallel_linear(),
            q_layernorm=norm,
            kv_layernorm=norm,
        ),
    )
