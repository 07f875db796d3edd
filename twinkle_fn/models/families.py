"""The model families the core knows: one `Family` row each, keyed by the HF ``model_type``.

A row holds every fact about a family that a backend needs and the HF config does not say: the
tensor-parallel plan, which projections carry biases, q/k norms, the mixture-of-experts layout and
which layers are MoE, how the decoder takes its masks, the config field of a sliding window, the
rotary layout, whether the transformers backend can run sequence parallelism and whether
megatron-core can build the family (if not, why). Backends read
rows (`family`), never family names, so an unknown family is refused up front with the list of
known ones rather than failing deep inside a parallel wrapper.

Adding a family
---------------
A new family touches:

1. ``twinkle_fn/models/families.py`` (this module): its `Family` row in `_ROWS`. Every field is
   required; `families_test.py` checks each against the model transformers builds (plan entries
   are real linears, biases and q/k norms exist exactly where the row says, the MoE-layer rule
   matches the layers that have experts, the window field windows attention...).
2. ``twinkle_fn/testing.py``: its tiny config in ``_EXTRA`` (2 layers, hidden 32: seconds on a
   CPU). This puts it under the conformance suite, ``tests/test_family_conformance.py``, and
   every other test parametrised over `FAMILIES`. The suite is what "supported" means: bridge
   round trip bit-exact on tp/pp/ep in {1, 2} (in one process and on two real ranks), megatron
   log-probs equal HF's, one training step equal on both backends, the tp plan, a LoRA adapter
   loading in peft, `tf.export_weights` loading into an HF model. Run it for one family with
   ``pytest tests/test_family_conformance.py -k <family>`` (the shared spawns still build every
   family: about a minute on 2 cores).

Bridge rules (``twinkle_fn/backends/megatron/bridge_rules.py``) are needed only for a tensor
layout they do not know yet. Known: Llama's (``self_attn.{q,k,v,o}_proj``,
``mlp.{gate,up,down}_proj``, ``input_layernorm``/``post_attention_layernorm``, RMSNorm,
optional q/k/v, o and MLP biases and q/k norms) and an MoE block of a router, per-expert
gate/up/down linears under any names and a shared expert with or without a sigmoid gate. A
fused qkv, LayerNorm, a router bias, multi-latent attention... need new rules, and megatron
config fields in ``config.py`` for whatever the row says that ``TransformerConfig`` must know.
A family megatron-core's ``GPTModel`` spec cannot express (Gemma 3's extra norms and per-layer
rotary base) sets `megatron` to the reason: the megatron backend refuses it with that reason
and the suite runs its transformers checks only.

What the later rows taught (GLM-4 MoE, DeepSeek-V3, Qwen3.5):

- A router is more than its linear: the scoring fields of `Moe` (sigmoid scores, an expert bias
  that only chooses experts, expert groups, a scaling factor) map to megatron's router settings
  in ``config.py``, which refuses what megatron computes differently (it always renormalises
  sigmoid weights; it scores a group by its top ``top_k // groups`` experts, HF by its top 2).
- A checkpoint tensor need not be a parameter: the router's ``e_score_correction_bias`` is a
  buffer. It needs a bridge rule (megatron's ``router.expert_bias``), both backends export it,
  and megatron must not move it (``moe_router_bias_update_rate=0``: HF never updates it).
- Layers can differ: first dense layers beside MoE layers (`after_first_k_dense`), DeltaNet
  layers beside attention layers. The tp plan is one mapping for every layer (an entry a layer
  lacks is skipped); linears that cannot be split go in `tp_whole`.
- peft rewrites any ``gate/up/down_proj`` target of an MoE model whose experts transformers fuses
  to the fused experts, so the megatron backend's ``"all-linear"`` adapts the attention only
  where the first dense MLPs share their names with the experts.
- Multi-latent attention (DeepSeek-V3, `latent_attention`) is its own set of bridge rules
  (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj`` or ``q_proj`` without ``q_lora_rank``,
  ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``), megatron's
  ``MLATransformerConfig`` and ``MLASelfAttention`` in the layer spec, and LoRA on those
  linears (``twinkle_fn/backends/megatron/mla.py``). Its rotary key is shared by every head,
  so a head-split tp plan leaves its gradient partial: both backends sum it over the tp ranks
  (the transformers backend's ``fsdp.SharedRotaryKey``, megatron's ``mla.py``).
- A hybrid family (Qwen3.5's Gated DeltaNet layers between gated attention layers) states its
  DeltaNet layers (`LinearAttention`), its ``1 + weight`` norms (`norm_offset`) and its gated
  ``q_proj`` (`attention_gate`); megatron builds it on ``GPTModel`` with megatron-core's
  ``GatedDeltaNet`` as those layers' attention (see ``twinkle_fn/backends/megatron/model.py``),
  with torch kernels where fla is missing (``gated_delta_net.py``). Packed rows need a
  convolution and a recurrence that restart at ``cu_seqlens``: megatron's DeltaNet takes them,
  the transformers backend restarts transformers' layers there (``linear_attention.py``).

To try a row without editing this module, `registered(row)` makes it known inside a ``with``
block only (``families_test.py`` trains a copy of qwen2 under another ``model_type`` that way).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Mapping
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


def typed_layers(kind: str) -> Callable[[PretrainedConfig], tuple[int, ...]]:
    """The rule "the layers whose ``config.layer_types`` entry is `kind`"."""

    def layers(config: PretrainedConfig) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(config.layer_types) if t == kind)

    return layers


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


def sparse_step_moe_layers(config: PretrainedConfig) -> tuple[int, ...]:
    """Qwen3-MoE's MoE layers (transformers' rule): layer ``i`` unless it is in
    ``mlp_only_layers``, when ``num_experts > 0`` and ``(i + 1) % decoder_sparse_step == 0``."""
    if not getattr(config, "num_experts", 0):
        return ()
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", 1) or 1
    layers = range(config.num_hidden_layers)
    return tuple(i for i in layers if i not in dense and (i + 1) % step == 0)


def after_first_k_dense(config: PretrainedConfig) -> tuple[int, ...]:
    """GLM-4 MoE's and DeepSeek-V3's MoE layers: every layer from ``first_k_dense_replace`` on
    (the first k are dense MLPs)."""
    return tuple(range(config.first_k_dense_replace, config.num_hidden_layers))


def n_shared_experts_ffn(config: PretrainedConfig) -> int:
    """The shared MLP of GLM-4 MoE / DeepSeek-V3: ``n_shared_experts`` experts' channels."""
    return config.moe_intermediate_size * config.n_shared_experts


def every_layer(config: PretrainedConfig) -> tuple[int, ...]:
    """Every decoder layer (Mixtral: all of them are MoE)."""
    return tuple(range(config.num_hidden_layers))


_ATTENTION = {
    "self_attn.q_proj": COLWISE,
    "self_attn.k_proj": COLWISE,
    "self_attn.v_proj": COLWISE,
    "self_attn.o_proj": ROWWISE,
}
_MLP = {"mlp.gate_proj": COLWISE, "mlp.up_proj": COLWISE, "mlp.down_proj": ROWWISE}

_ROWS = (
    Family(
        name="llama",
        tp_plan={**_ATTENTION, **_MLP},
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        mlp_bias="mlp_bias",
        qk_norm=False,
        moe=None,
        mask_mapping=False,
        sliding_window=None,
        rope="rotate_half",
        sequence_parallel=True,
        megatron=None,
    ),
    Family(
        name="mistral",
        tp_plan={**_ATTENTION, **_MLP},
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        moe=None,
        mask_mapping=False,
        sliding_window="sliding_window",
        rope="rotate_half",
        sequence_parallel=True,
        megatron=None,
    ),
    Family(
        name="qwen2",
        tp_plan={**_ATTENTION, **_MLP},
        qkv_bias=True,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        moe=None,
        mask_mapping=True,
        # Qwen2/Qwen3 windows are per layer (use_sliding_window, max_window_layers)
        sliding_window=None,
        rope="rotate_half",
        sequence_parallel=True,
        megatron=None,
    ),
    Family(
        name="qwen3",
        tp_plan={**_ATTENTION, **_MLP},
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        mlp_bias=False,
        qk_norm=True,
        moe=None,
        mask_mapping=True,
        sliding_window=None,
        rope="rotate_half",
        sequence_parallel=True,
        megatron=None,
    ),
    Family(
        name="qwen3_moe",
        # Dense layers (mlp_only_layers) keep their MLP whole too: one plan serves every layer.
        tp_plan=dict(_ATTENTION),
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        mlp_bias=False,
        qk_norm=True,
        moe=Moe(
            layers=sparse_step_moe_layers,
            router="mlp.gate",
            experts="mlp.experts",
            expert_linears=("gate_proj", "up_proj", "down_proj"),
            num_experts="num_experts",
            top_k="num_experts_per_tok",
            ffn="moe_intermediate_size",
            renormalize="norm_topk_prob",
            shared=None,
        ),
        mask_mapping=False,
        # transformers leaves it None unless use_sliding_window (then every layer has it).
        sliding_window="sliding_window",
        rope="rotate_half",
        sequence_parallel=False,
        megatron=None,
    ),
    Family(
        name="qwen2_moe",
        # The shared expert is a dense MLP on every token: split like one. Its sigmoid gate
        # ([1, hidden]) and the routed experts stay whole.
        tp_plan={
            **_ATTENTION,
            "mlp.shared_expert.gate_proj": COLWISE,
            "mlp.shared_expert.up_proj": COLWISE,
            "mlp.shared_expert.down_proj": ROWWISE,
        },
        qkv_bias="qkv_bias",
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        moe=Moe(
            layers=sparse_step_moe_layers,
            router="mlp.gate",
            experts="mlp.experts",
            expert_linears=("gate_proj", "up_proj", "down_proj"),
            num_experts="num_experts",
            top_k="num_experts_per_tok",
            ffn="moe_intermediate_size",
            renormalize="norm_topk_prob",
            shared=SharedExpert(
                mlp="mlp.shared_expert",
                linears=("gate_proj", "up_proj", "down_proj"),
                ffn="shared_expert_intermediate_size",
                gate="mlp.shared_expert_gate",
            ),
        ),
        mask_mapping=True,
        # as qwen2: windows per layer only with use_sliding_window (refused by megatron)
        sliding_window=None,
        rope="rotate_half",
        # the routed experts' output is not a rowwise linear's
        sequence_parallel=False,
        megatron=None,
    ),
    Family(
        name="mixtral",
        tp_plan=dict(_ATTENTION),
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        moe=Moe(
            layers=every_layer,
            router="block_sparse_moe.gate",
            experts="block_sparse_moe.experts",
            expert_linears=("w1", "w3", "w2"),
            num_experts="num_local_experts",
            top_k="num_experts_per_tok",
            ffn="intermediate_size",
            renormalize=True,
            shared=None,
        ),
        mask_mapping=False,
        sliding_window="sliding_window",
        rope="rotate_half",
        sequence_parallel=False,
        megatron=None,
    ),
    Family(
        name="glm4_moe",
        # the first_k_dense_replace dense layers split their MLP, the MoE layers their shared
        # experts; routed experts and the router stay whole
        tp_plan={
            **_ATTENTION,
            **_MLP,
            "mlp.shared_experts.gate_proj": COLWISE,
            "mlp.shared_experts.up_proj": COLWISE,
            "mlp.shared_experts.down_proj": ROWWISE,
        },
        qkv_bias="attention_bias",
        o_bias=False,
        mlp_bias=False,
        qk_norm="use_qk_norm",
        moe=Moe(
            layers=after_first_k_dense,
            router="mlp.gate",
            experts="mlp.experts",
            expert_linears=("gate_proj", "up_proj", "down_proj"),
            num_experts="n_routed_experts",
            top_k="num_experts_per_tok",
            ffn="moe_intermediate_size",
            renormalize="norm_topk_prob",
            shared=SharedExpert(
                mlp="mlp.shared_experts",
                linears=("gate_proj", "up_proj", "down_proj"),
                ffn=n_shared_experts_ffn,
                gate=None,
            ),
            score="sigmoid",
            expert_bias="e_score_correction_bias",
            groups="n_group",
            group_topk="topk_group",
            scale="routed_scaling_factor",
        ),
        mask_mapping=False,
        sliding_window=None,
        # partial rotary (rope_parameters' partial_rotary_factor): the first channels of each
        # head are rotated in HF's rotate_half layout, the rest pass through
        rope="rotate_half",
        sequence_parallel=False,
        megatron=None,
    ),
    Family(
        name="deepseek_v3",
        # multi-latent attention: the up projections (q_b_proj, or q_proj without q_lora_rank,
        # and kv_b_proj) give each head its rows, so they split by heads like q/k/v; the down
        # projections feed every head and stay whole (tp_whole).
        tp_plan={
            "self_attn.q_b_proj": COLWISE,
            "self_attn.q_proj": COLWISE,
            "self_attn.kv_b_proj": COLWISE,
            "self_attn.o_proj": ROWWISE,
            **_MLP,
            "mlp.shared_experts.gate_proj": COLWISE,
            "mlp.shared_experts.up_proj": COLWISE,
            "mlp.shared_experts.down_proj": ROWWISE,
        },
        tp_whole=("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"),
        qkv_bias=False,
        o_bias="attention_bias",
        mlp_bias=False,
        qk_norm=False,
        moe=Moe(
            layers=after_first_k_dense,
            router="mlp.gate",
            experts="mlp.experts",
            expert_linears=("gate_proj", "up_proj", "down_proj"),
            num_experts="n_routed_experts",
            top_k="num_experts_per_tok",
            ffn="moe_intermediate_size",
            renormalize="norm_topk_prob",
            shared=SharedExpert(
                mlp="mlp.shared_experts",
                linears=("gate_proj", "up_proj", "down_proj"),
                ffn=n_shared_experts_ffn,
                gate=None,
            ),
            score="sigmoid",
            expert_bias="e_score_correction_bias",
            groups="n_group",
            group_topk="topk_group",
            scale="routed_scaling_factor",
        ),
        mask_mapping=False,
        sliding_window=None,
        # rope_interleave (default True): neighbouring channels of the rotary part are pairs
        rope="interleaved",
        sequence_parallel=False,
        latent_attention=True,
        megatron=None,
    ),
    Family(
        name="qwen3_5_text",
        # Gated DeltaNet layers (linear_attn) between full attention layers (layer_types). The
        # full attention's q_proj gives each head its query and its output gate side by side,
        # so it splits by heads; a DeltaNet's fused q/k/v rows and depthwise convolution do
        # not split per head that way: its linears stay whole (tp_whole).
        tp_plan={**_ATTENTION, **_MLP},
        tp_whole=(
            "linear_attn.in_proj_qkv",
            "linear_attn.in_proj_z",
            "linear_attn.in_proj_b",
            "linear_attn.in_proj_a",
            "linear_attn.out_proj",
        ),
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        mlp_bias=False,
        qk_norm=True,
        moe=None,
        mask_mapping=True,
        sliding_window=None,
        rope="rotate_half",
        # a DeltaNet layer is outside the sequence-parallel plan (it needs the whole sequence)
        sequence_parallel=False,
        megatron=None,
        linear_attention=LinearAttention(
            layers=typed_layers("linear_attention"), module="linear_attn"
        ),
        norm_offset=True,
        attention_gate=True,
    ),
    Family(
        name="qwen3_5_moe_text",
        # qwen3_5_text's layers (Gated DeltaNet between full attention layers) with an MoE block
        # in every layer: routed experts (whole under tp, split over ep) beside a shared expert
        # that splits like a dense MLP; its sigmoid gate ([1, hidden]) stays whole.
        tp_plan={
            **_ATTENTION,
            "mlp.shared_expert.gate_proj": COLWISE,
            "mlp.shared_expert.up_proj": COLWISE,
            "mlp.shared_expert.down_proj": ROWWISE,
        },
        tp_whole=(
            "linear_attn.in_proj_qkv",
            "linear_attn.in_proj_z",
            "linear_attn.in_proj_b",
            "linear_attn.in_proj_a",
            "linear_attn.out_proj",
        ),
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        mlp_bias=False,
        qk_norm=True,
        moe=Moe(
            layers=every_layer,
            router="mlp.gate",
            experts="mlp.experts",
            expert_linears=("gate_proj", "up_proj", "down_proj"),
            num_experts="num_experts",
            top_k="num_experts_per_tok",
            ffn="moe_intermediate_size",
            # its router always renormalises the top-k weights (no norm_topk_prob field)
            renormalize=True,
            shared=SharedExpert(
                mlp="mlp.shared_expert",
                linears=("gate_proj", "up_proj", "down_proj"),
                ffn="shared_expert_intermediate_size",
                gate="mlp.shared_expert_gate",
            ),
        ),
        mask_mapping=True,
        sliding_window=None,
        rope="rotate_half",
        # a DeltaNet layer needs the whole sequence; the routed experts' output is not a
        # rowwise linear's
        sequence_parallel=False,
        megatron=(
            "twinkle's megatron layer spec builds Gated DeltaNet layers (qwen3_5_text) with a "
            "dense MLP only: an MoE block with a gated shared expert after a DeltaNet is not "
            "built, nor bridged, yet"
        ),
        linear_attention=LinearAttention(
            layers=typed_layers("linear_attention"), module="linear_attn"
        ),
        norm_offset=True,
        attention_gate=True,
        packed_rows=(
            "the Gated DeltaNet layers' recurrence and causal convolution (transformers' torch "
            "code, and fla's kernels as transformers calls them) do not restart at the packed "
            "samples' boundaries, so samples would read each other"
        ),
    ),
    Family(
        name="gemma3_text",
        tp_plan={**_ATTENTION, **_MLP},
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        mlp_bias=False,
        qk_norm=True,
        moe=None,
        mask_mapping=True,
        # only the sliding layers of layer_types are windowed (the backends read each layer's)
        sliding_window=None,
        rope="rotate_half",
        # the norms after attention and after the MLP are outside the sequence-parallel plan
        sequence_parallel=False,
        megatron=(
            "megatron-core's GPTModel layer spec has no norms on the attention and MLP outputs "
            "(Gemma 3's pre/post-feedforward norms), no per-layer rotary base "
            "(rope_local_base_freq on sliding layers), no scaled embedding and no (1 + weight) "
            "RMSNorm"
        ),
    ),
)
_BUILTIN: Mapping[str, Family] = MappingProxyType({row.name: row for row in _ROWS})

FAMILIES: tuple[str, ...] = tuple(_BUILTIN)

# Rows made known by `registered`, for the current thread or task only.
_SCOPED: contextvars.ContextVar[Mapping[str, Family]] = contextvars.ContextVar(
    "twinkle_fn_scoped_families", default=MappingProxyType({})
)


def _table() -> Mapping[str, Family]:
    return {**_BUILTIN, **_SCOPED.get()}


def known() -> tuple[str, ...]:
    """The names of the families known here: `FAMILIES`, then any `registered` inside a block."""
    return tuple(_table())


@contextlib.contextmanager
def registered(*rows: Family) -> Iterator[None]:
    """Within the ``with`` block, `family` and `family_of` also know `rows` (a row named like a
    known family replaces it); afterwards the table is as before.

    The rows are known to the thread (or asyncio task) that entered the block, which is where
    twinkle's single-process `init`/`fwd_bwd`/`step` run; other processes never see them.
    Raises ``ValueError`` when two of `rows` share a name.
    """
    names = [row.name for row in rows]
    if len(set(names)) != len(names):
        raise ValueError(f"registered rows share a name: {names}")
    token = _SCOPED.set(MappingProxyType({**_SCOPED.get(), **{r.name: r for r in rows}}))
    try:
        yield
    finally:
        _SCOPED.reset(token)


# Multimodal wrappers whose text model is a known family: the config users should load instead.
TEXT_CONFIGS: Mapping[str, str] = MappingProxyType({"gemma3": "gemma3_text"})


def family_of(config: PretrainedConfig) -> str:
    """The family name of `config` (its ``model_type``).

    Raises ``ValueError`` naming the model type and the supported families when it is unknown
    (for a multimodal wrapper of a known text family, naming the text config to load).
    """
    model_type = getattr(config, "model_type", None)
    table = _table()
    if model_type not in table:
        hint = ""
        if model_type in TEXT_CONFIGS:
            hint = (
                f" {model_type!r} wraps a vision tower around a text model: load its text "
                f"config (model_type {TEXT_CONFIGS[model_type]!r}, e.g. config.text_config)."
            )
        raise ValueError(
            f"unknown model family {model_type!r} (config.model_type); twinkle supports "
            f"{', '.join(table)}. Use a config of one of these families.{hint}"
        )
    return model_type


def family(name_or_config: str | PretrainedConfig) -> Family:
    """The row of a family, by name or by an HF config of it.

    Raises ``ValueError`` naming the known families when it is unknown (for a config, also its
    ``model_type`` field, as `family_of` does).
    """
    if isinstance(name_or_config, str):
        table = _table()
        if name_or_config not in table:
            raise ValueError(
                f"unknown model family {name_or_config!r}; twinkle supports {', '.join(table)}"
            )
        return table[name_or_config]
    return _table()[family_of(name_or_config)]
