"""The type of a row of the family table (`twinkle_fn.models.families`): `Family` and the parts
it is made of (`Moe`, `SharedExpert`, `LinearAttention`, `Flag`), with the values a row may hold
and the tensor-parallel plan fragments the rows share."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType

from transformers import PretrainedConfig

COLWISE, ROWWISE = "colwise", "rowwise"
TP_STYLES = (COLWISE, ROWWISE)
# HF's ``rotate_half`` pairs dimension i with i + head_dim / 2 (megatron: not interleaved);
# "interleaved" pairs neighbouring dimensions (GPT-J; megatron's ``rotary_interleaved``).
ROPE_KINDS = ("rotate_half", "interleaved")
BIAS_PARTS = ("qkv", "o", "mlp")
ROUTER_SCORES = ("softmax", "sigmoid")

# A switch: always on (True), always off (False), or the name of the HF config field that sets it.
Flag = bool | str


def flag_on(flag: Flag, config: PretrainedConfig) -> bool:
    """Whether `flag` is on for `config` (a named field that `config` lacks is off)."""
    return flag if isinstance(flag, bool) else bool(getattr(config, flag, False))


@dataclasses.dataclass(frozen=True)
class SharedExpert:
    """An MLP that every token of an MoE layer goes through beside its routed experts.

    `mlp`: its decoder-layer submodule, as the checkpoint names it, whose linears `linears`
    (gate, up, down) are ``{mlp}.{name}.weight``; `ffn`: the config field of its intermediate
    size, or a function of the config giving it (GLM-4 MoE and DeepSeek-V3 size it as
    ``n_shared_experts`` routed experts). `gate`: the decoder-layer submodule of a
    ``[1, hidden]`` linear whose sigmoid scales the MLP's output per token (Qwen2-MoE), None
    when the output is added ungated.
    """

    mlp: str
    linears: tuple[str, str, str]
    ffn: str | Callable[[PretrainedConfig], int]
    gate: str | None

    def size(self, config: PretrainedConfig) -> int:
        """The shared MLP's intermediate size under `config`."""
        return self.ffn(config) if callable(self.ffn) else getattr(config, self.ffn)


@dataclasses.dataclass(frozen=True)
class Moe:
    """Where a family keeps its routed experts and which decoder layers have them.

    `layers`: THE rule of which decoder layers are MoE, a function of the HF config returning
    their indices in increasing order (the others are dense MLPs). Names are the checkpoint's
    (what ``save_pretrained`` writes and the megatron bridge reads; transformers may rename or
    fuse them in memory, e.g. Mixtral's ``block_sparse_moe`` is ``mlp`` there). `router`: the
    decoder-layer submodule of the router linear (its ``.weight`` is ``[experts, hidden]``).
    `experts`: the decoder-layer submodule of the experts; expert ``e``'s linears are
    ``{experts}.{e}.{name}.weight`` with the names `expert_linears` (gate, up, down).
    `num_experts`, `top_k` and `ffn` name the config fields of the expert count, the experts
    per token and one expert's intermediate size; `renormalize` says whether the top-k routing
    weights (a softmax over all experts) are renormalised to sum to 1. `shared`: the shared
    expert, None without one.

    The router's scoring (defaults: Qwen/Mixtral's softmax router): `score` is ``"softmax"``
    or ``"sigmoid"`` (each expert's score is the sigmoid of its logit; GLM-4 MoE, DeepSeek-V3).
    `expert_bias`: the name, under `router`, of a per-expert bias added to the scores only to
    choose the experts (``e_score_correction_bias``: a buffer, not trained), None without one.
    `groups` / `group_topk`: the config fields of the expert groups and of how many groups a
    token may choose from (a group's score is the sum of its top 2 expert scores), None for
    ungrouped routing. `scale`: the config field of the factor the routing weights are
    multiplied by after normalising (``routed_scaling_factor``), None for 1.
    """

    layers: Callable[[PretrainedConfig], tuple[int, ...]]
    router: str
    experts: str
    expert_linears: tuple[str, str, str]
    num_experts: str
    top_k: str
    ffn: str
    renormalize: Flag
    shared: SharedExpert | None
    score: str = "softmax"
    expert_bias: str | None = None
    groups: str | None = None
    group_topk: str | None = None
    scale: str | None = None

    def __post_init__(self) -> None:
        if self.score not in ROUTER_SCORES:
            raise ValueError(f"Moe score {self.score!r} is not one of {ROUTER_SCORES}")
        if (self.groups is None) != (self.group_topk is None):
            raise ValueError(
                f"Moe groups={self.groups!r} with group_topk={self.group_topk!r}: "
                "give both config fields or neither"
            )


@dataclasses.dataclass(frozen=True)
class LinearAttention:
    """Gated DeltaNet (linear attention) layers beside a family's attention layers (Qwen3.5).

    `layers`: THE rule of which decoder layers are linear attention, a function of the HF config
    returning their indices in increasing order (the others attend fully). `module`: the
    decoder-layer submodule of the DeltaNet, laid out as transformers' Qwen3.5 lays it out:
    ``in_proj_qkv`` (queries, keys, values of every head), ``in_proj_z`` (the output gate),
    ``in_proj_b`` / ``in_proj_a`` (per value head: beta, the decay's input), ``conv1d``,
    ``A_log``, ``dt_bias``, ``norm`` (a gated RMSNorm of plain ``weight``) and ``out_proj``;
    its sizes are the config's ``linear_*`` fields.
    """

    layers: Callable[[PretrainedConfig], tuple[int, ...]]
    module: str


@dataclasses.dataclass(frozen=True)
class Family:
    """Everything a backend needs to know about one model family (one row of the table).

    `name`: the HF ``model_type``. `tp_plan`: decoder-layer submodule -> ``"colwise"`` (output
    features split over tp) or ``"rowwise"`` (input features split, outputs summed); MoE experts
    are left out (they stay whole under tp). `qkv_bias`, `o_bias`, `mlp_bias`: whether the q/k/v,
    output and dense MLP projections carry biases (`Flag`). `qk_norm`: RMSNorms on each head's
    queries and keys (``self_attn.q_norm`` / ``k_norm``; a `Flag`, read with `has_qk_norm`). `moe`: the experts' layout, None for a
    dense family. `mask_mapping`: the decoder takes ready-made masks as ``{layer type: mask}``
    (``{"full_attention": None}`` skips transformers' mask building). `sliding_window`: the config
    field whose value (when set) is a window of that many tokens, the query included, in every
    layer; None when no field means that. `rope`: the rotary layout (`ROPE_KINDS`).
    `sequence_parallel`: the transformers backend can add sequence parallelism to the tp plan
    (that needs the MLP to end in a rowwise linear, and every norm of a layer in its sequence
    parallel plan). `megatron`: None when megatron-core's ``GPTModel`` builds the family,
    else why it cannot (the megatron backend refuses the family with it). `tp_whole`: the
    decoder-layer linears that stay whole on every tp rank (their output is read by every head:
    multi-latent attention's down projections, a linear-attention layer's projections).
    `packed_rows`: None when the transformers backend trains packed rows (``cu_seqlens``), else
    why it cannot (it refuses them with the reason). `tensor_parallel`: None when the
    transformers backend splits the family over tp > 1 by `tp_plan`, else why it cannot.
    `latent_attention`: the attention is multi-latent (DeepSeek-V2/V3: ``q_a_proj`` /
    ``q_a_layernorm`` / ``q_b_proj``, or ``q_proj`` without ``q_lora_rank``, then
    ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``; head dims from
    ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``), not q/k/v projections.
    `linear_attention`: the family's Gated DeltaNet layers, None without. `norm_offset`: its
    RMSNorms scale by ``1 + weight`` (weights stored centred on 0; a DeltaNet's gated norm
    excepted). `attention_gate`: ``q_proj`` gives each head its query and then a gate of as
    many channels (``[heads, 2, head_dim]`` rows), whose sigmoid scales the head's attention
    output. Raises ``ValueError`` for a style, rope kind or bias flag outside those listed.
    """

    name: str
    tp_plan: Mapping[str, str] = dataclasses.field(hash=False)
    qkv_bias: Flag
    o_bias: Flag
    mlp_bias: Flag
    qk_norm: Flag
    moe: Moe | None
    mask_mapping: bool
    sliding_window: str | None
    rope: str
    sequence_parallel: bool
    megatron: str | None
    tp_whole: tuple[str, ...] = ()
    packed_rows: str | None = None
    tensor_parallel: str | None = None
    linear_attention: LinearAttention | None = None
    norm_offset: bool = False
    attention_gate: bool = False
    latent_attention: bool = False

    def __post_init__(self) -> None:
        bad = {sub: style for sub, style in self.tp_plan.items() if style not in TP_STYLES}
        if bad:
            raise ValueError(f"family {self.name!r}: tp_plan styles {bad} are not in {TP_STYLES}")
        if self.rope not in ROPE_KINDS:
            raise ValueError(f"family {self.name!r}: rope {self.rope!r} is not in {ROPE_KINDS}")
        for part in BIAS_PARTS:
            flag = getattr(self, f"{part}_bias")
            if not isinstance(flag, bool | str) or flag == "":
                raise ValueError(
                    f"family {self.name!r}: {part}_bias={flag!r}; use True, False or a config field"
                )
        # Read-only, so that no caller edits the table through a row.
        object.__setattr__(self, "tp_plan", MappingProxyType(dict(self.tp_plan)))

    def has_bias(self, part: str, config: PretrainedConfig) -> bool:
        """Whether projection `part` (``"qkv"``, ``"o"`` or ``"mlp"``) has biases under `config`.

        Raises ``ValueError`` for another `part`.
        """
        if part not in BIAS_PARTS:
            raise ValueError(f"bias part {part!r} is not one of {BIAS_PARTS}")
        return flag_on(getattr(self, f"{part}_bias"), config)

    def has_qk_norm(self, config: PretrainedConfig) -> bool:
        """Whether the attention has q/k RMSNorms under `config`."""
        return flag_on(self.qk_norm, config)

    def moe_layers(self, config: PretrainedConfig) -> tuple[int, ...]:
        """The indices of `config`'s MoE decoder layers, increasing; () for a dense family."""
        return () if self.moe is None else self.moe.layers(config)

    def window(self, config: PretrainedConfig) -> int | None:
        """`config`'s sliding window in tokens (the query included), or None for full attention
        (no window field, or the field unset)."""
        if self.sliding_window is None:
            return None
        return getattr(config, self.sliding_window, None) or None


# The Llama-layout attention and MLP linears, split by heads / MLP channels.
ATTENTION_PLAN: Mapping[str, str] = MappingProxyType(
    {
        "self_attn.q_proj": COLWISE,
        "self_attn.k_proj": COLWISE,
        "self_attn.v_proj": COLWISE,
        "self_attn.o_proj": ROWWISE,
    }
)


def mlp_plan(mlp: str) -> Mapping[str, str]:
    """The tp plan of the gated MLP at decoder-layer submodule `mlp` (a dense MLP, a shared
    expert): ``gate_proj`` / ``up_proj`` split by channels, ``down_proj`` summed over them."""
    return MappingProxyType(
        {f"{mlp}.gate_proj": COLWISE, f"{mlp}.up_proj": COLWISE, f"{mlp}.down_proj": ROWWISE}
    )


MLP_PLAN = mlp_plan("mlp")
