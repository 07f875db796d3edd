"""The HF <-> megatron-core bridge tables and where they place tensors.

One table of `Rule` rows per model family (`rules_for`, assembled from the family's row in
`twinkle_fn.models.families`: biases, q/k norms, the MoE layout), which layers are routed-MoE
(`moe_layers`, the row's rule) and the rows tp splits in multi-latent attention
(`mla_split_rows`). The model and parallel layout the tables are laid out over, and the
expansion of a table into the concrete tensors of one pipeline stage and expert-parallel rank,
are in `twinkle_fn.backends.megatron.bridge_layout`; the functions that move tensors
(`hf_to_mcore`, `mcore_to_hf`) in `twinkle_fn.backends.megatron.bridge`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from transformers import PretrainedConfig

from twinkle_fn.models.families import Family, Moe, family

TRANSFORMS: dict[str, int] = {
    "copy": 1,
    "vocab": 1,
    "qkv": 3,
    "gate_up": 2,
    "gated_qkv": 3,
    "gdn_in_proj": 4,
    "gdn_conv": 1,
}
STAGES = ("first", "layer", "last")
LAYER_KINDS = ("all", "dense", "moe")
MIXERS = ("all", "attention", "linear")


@dataclass(frozen=True)
class Rule:
    """One row of a family's table: HF tensors `hf` <-> megatron-core tensor `mcore`.

    `hf` and `mcore` are patterns with ``{layer}`` (global index in `hf`, stage-local in
    `mcore`) and ``{expert}`` (global in `hf`, local to the expert-parallel rank in `mcore`).
    `transform` is one of `TRANSFORMS` ('copy', 'vocab': pad to megatron's vocabulary, 'qkv':
    fuse per query group, 'gate_up': fuse per TP rank, 'gated_qkv': 'qkv' of a gated
    ``q_proj`` (each group's queries, then its gates), 'gdn_in_proj' / 'gdn_conv': a Gated
    DeltaNet's q, k, v (, z, beta, alpha) sections fused per TP rank); `tp_dim` is the dim of the megatron
    tensor that tensor parallelism splits (expert tensors: expert tensor parallelism), ``None``
    when replicated. `stage` places the tensor on the first pipeline stage, in every layer, or
    on the last stage; `layers` restricts a layer rule to dense or MoE layers and `mixer` to
    attention or linear-attention (Gated DeltaNet) layers; a `tied` rule is the last stage's
    copy of a tied embedding (imported, never exported). Raises ``ValueError`` for an unknown
    transform, stage, layer kind or mixer, or a wrong number of names.
    """

    hf: tuple[str, ...]
    mcore: str
    transform: str
    tp_dim: int | None
    stage: str = "layer"
    layers: str = "all"
    tied: bool = False
    mixer: str = "all"

    def __post_init__(self) -> None:
        if self.transform not in TRANSFORMS:
            raise ValueError(f"Rule transform {self.transform!r} is not one of {list(TRANSFORMS)}")
        if len(self.hf) != TRANSFORMS[self.transform]:
            raise ValueError(
                f"Rule for {self.mcore!r}: transform {self.transform!r} takes "
                f"{TRANSFORMS[self.transform]} HF names, got {len(self.hf)}"
            )
        if self.stage not in STAGES:
            raise ValueError(f"Rule stage {self.stage!r} is not one of {STAGES}")
        if self.layers not in LAYER_KINDS:
            raise ValueError(f"Rule layers {self.layers!r} is not one of {LAYER_KINDS}")
        if self.mixer not in MIXERS:
            raise ValueError(f"Rule mixer {self.mixer!r} is not one of {MIXERS}")
        if self.transform != "copy" and self.tp_dim != 0:
            raise ValueError(f"Rule for {self.mcore!r}: {self.transform!r} splits dim 0 over tp")

    @property
    def expert(self) -> bool:
        """Whether the tensor belongs to one routed expert (split over ep, then etp)."""
        return "{expert}" in self.mcore


_L, _M = "model.layers.{layer}.", "decoder.layers.{layer}."
_MC_EXPERT = _M + "mlp.experts.local_experts.{expert}."


def _qkv(suffix: str) -> tuple[str, ...]:
    return tuple(f"{_L}self_attn.{p}_proj.{suffix}" for p in "qkv")


EMBEDDING = Rule(
    ("model.embed_tokens.weight",), "embedding.word_embeddings.weight", "vocab", 0, stage="first"
)
INPUT_NORM = Rule((_L + "input_layernorm.weight",), _M + "input_layernorm.weight", "copy", None)
QKV = Rule(_qkv("weight"), _M + "self_attention.linear_qkv.weight", "qkv", 0)
QKV_BIAS = Rule(_qkv("bias"), _M + "self_attention.linear_qkv.bias", "qkv", 0)
QK_NORM = (
    Rule((_L + "self_attn.q_norm.weight",), _M + "self_attention.q_layernorm.weight", "copy", None),
    Rule((_L + "self_attn.k_norm.weight",), _M + "self_attention.k_layernorm.weight", "copy", None),
)
O_PROJ = Rule(
    (_L + "self_attn.o_proj.weight",), _M + "self_attention.linear_proj.weight", "copy", 1
)
O_BIAS = Rule((_L + "self_attn.o_proj.bias",), _M + "self_attention.linear_proj.bias", "copy", None)
POST_ATTN_NORM = Rule(
    (_L + "post_attention_layernorm.weight",), _M + "pre_mlp_layernorm.weight", "copy", None
)
MLP = (
    Rule(
        (_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"),
        _M + "mlp.linear_fc1.weight",
        "gate_up",
        0,
        layers="dense",
    ),
    Rule((_L + "mlp.down_proj.weight",), _M + "mlp.linear_fc2.weight", "copy", 1, layers="dense"),
)
MLP_BIAS = (
    Rule(
        (_L + "mlp.gate_proj.bias", _L + "mlp.up_proj.bias"),
        _M + "mlp.linear_fc1.bias",
        "gate_up",
        0,
        layers="dense",
    ),
    Rule((_L + "mlp.down_proj.bias",), _M + "mlp.linear_fc2.bias", "copy", None, layers="dense"),
)
FINAL_NORM = Rule(
    ("model.norm.weight",), "decoder.final_layernorm.weight", "copy", None, stage="last"
)
LM_HEAD = Rule(("lm_head.weight",), "output_layer.weight", "vocab", 0, stage="last")
TIED_LM_HEAD = Rule(
    ("model.embed_tokens.weight",), "output_layer.weight", "vocab", 0, stage="last", tied=True
)
# A critic's value head (transformers' token-classification ``score``, one label): replicated.
VALUE_HEAD = Rule(("score.weight",), "output_layer.weight", "copy", None, stage="last")
VALUE_BIAS = Rule(("score.bias",), "output_layer.bias", "copy", None, stage="last")
HEADS = ("lm", "value")

# Multi-latent attention (`Family.latent_attention`; megatron-core's ``MLASelfAttention``).
# The up projections give each head its rows (head-major, as in HF), so tp splits them by
# heads; megatron builds the down projections as column-parallel linears too, split by rows
# (their outputs are gathered before use, see `twinkle_fn.backends.megatron.mla`).
_A, _MA = _L + "self_attn.", _M + "self_attention."
MLA_Q_DOWN = Rule((_A + "q_a_proj.weight",), _MA + "linear_q_down_proj.weight", "copy", 0)
MLA_Q_NORM = Rule((_A + "q_a_layernorm.weight",), _MA + "q_layernorm.weight", "copy", None)
MLA_Q_UP = Rule((_A + "q_b_proj.weight",), _MA + "linear_q_up_proj.weight", "copy", 0)
MLA_Q = Rule((_A + "q_proj.weight",), _MA + "linear_q_proj.weight", "copy", 0)
MLA_KV_DOWN = Rule(
    (_A + "kv_a_proj_with_mqa.weight",), _MA + "linear_kv_down_proj.weight", "copy", 0
)
MLA_KV_NORM = Rule((_A + "kv_a_layernorm.weight",), _MA + "kv_layernorm.weight", "copy", None)
MLA_KV_UP = Rule((_A + "kv_b_proj.weight",), _MA + "linear_kv_up_proj.weight", "copy", 0)


def mla_rules(hf_config: PretrainedConfig) -> tuple[Rule, ...]:
    """The rules of a multi-latent attention's projections and norms but ``o_proj``, in HF
    order: the query's down projection, norm and up projection (``q_proj`` alone when
    ``q_lora_rank`` is None), then the keys' and values'."""
    query = (MLA_Q_DOWN, MLA_Q_NORM, MLA_Q_UP) if hf_config.q_lora_rank is not None else (MLA_Q,)
    return (*query, MLA_KV_DOWN, MLA_KV_NORM, MLA_KV_UP)


def value_bias(hf_config: PretrainedConfig) -> bool:
    """Whether a critic of `hf_config` has a bias on its value head (transformers'
    ``token_classification_bias``, default True)."""
    return bool(getattr(hf_config, "token_classification_bias", True))


def moe_rules(moe: Moe) -> tuple[Rule, ...]:
    """The rules of an MoE layer's router, experts and shared expert (megatron-core's
    ``mlp.shared_experts``, split over tp like a dense MLP, its gate whole), named as `moe`
    lays them out in HF checkpoints (one tensor per expert)."""
    gate, up, down = (f"{_L}{moe.experts}.{{expert}}.{name}.weight" for name in moe.expert_linears)
    rules = [
        Rule((f"{_L}{moe.router}.weight",), _M + "mlp.router.weight", "copy", None, layers="moe"),
        *(
            [
                Rule(
                    (f"{_L}{moe.router}.{moe.expert_bias}",),
                    _M + "mlp.router.expert_bias",
                    "copy",
                    None,
                    layers="moe",
                )
            ]
            if moe.expert_bias is not None
            else []
        ),
        Rule((gate, up), _MC_EXPERT + "linear_fc1.weight", "gate_up", 0, layers="moe"),
        Rule((down,), _MC_EXPERT + "linear_fc2.weight", "copy", 1, layers="moe"),
    ]
    if moe.shared is not None:
        sh = moe.shared
        s_gate, s_up, s_down = (f"{_L}{sh.mlp}.{name}.weight" for name in sh.linears)
        shared = _M + "mlp.shared_experts."
        rules += [
            Rule((s_gate, s_up), shared + "linear_fc1.weight", "gate_up", 0, layers="moe"),
            Rule((s_down,), shared + "linear_fc2.weight", "copy", 1, layers="moe"),
        ]
        if sh.gate is not None:
            gate_rule = Rule(
                (f"{_L}{sh.gate}.weight",), shared + "gate_weight", "copy", None, layers="moe"
            )
            rules.append(gate_rule)
    return tuple(rules)


def gated_delta_net_rules(module: str) -> tuple[Rule, ...]:
    """The rules of a Gated DeltaNet layer's mixer, the HF decoder-layer submodule `module` laid
    out as `twinkle_fn.models.families.LinearAttention` says, as megatron-core's
    ``GatedDeltaNet`` (the layer's ``self_attention``): ``in_proj`` fuses q, k, v, z, beta and
    alpha per tp rank, ``conv1d`` its q, k, v channels likewise; ``A_log`` / ``dt_bias`` split
    by value heads, ``out_proj`` by its input, the gated norm whole."""
    hf, mc = f"{_L}{module}.", _M + "self_attention."
    return tuple(
        dataclasses.replace(rule, mixer="linear")
        for rule in (
            Rule(
                tuple(f"{hf}in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")),
                mc + "in_proj.weight",
                "gdn_in_proj",
                0,
            ),
            Rule((hf + "conv1d.weight",), mc + "conv1d.weight", "gdn_conv", 0),
            Rule((hf + "dt_bias",), mc + "dt_bias", "copy", 0),
            Rule((hf + "A_log",), mc + "A_log", "copy", 0),
            Rule((hf + "norm.weight",), mc + "out_norm.weight", "copy", None),
            Rule((hf + "out_proj.weight",), mc + "out_proj.weight", "copy", 1),
        )
    )


def attention_rules(hf_config: PretrainedConfig) -> list[Rule]:
    """The rules of `hf_config`'s attention (q/k/v, their biases, q/k norms, or multi-latent
    attention's linears and norms; o_proj and its bias), marked as attention layers' when the family also has Gated DeltaNet layers, whose
    rules follow (`gated_delta_net_rules`). Raises ``ValueError`` as `megatron_family`."""
    fam = megatron_family(hf_config)
    if fam.latent_attention:
        rules = [*mla_rules(hf_config), O_PROJ]
    else:
        qkv = [QKV, *([QKV_BIAS] if fam.has_bias("qkv", hf_config) else [])]
        if fam.attention_gate:
            qkv = [dataclasses.replace(rule, transform="gated_qkv") for rule in qkv]
        rules = [*qkv, *(QK_NORM if fam.has_qk_norm(hf_config) else ()), O_PROJ]
    rules += [O_BIAS] if fam.has_bias("o", hf_config) else []
    if fam.linear_attention is None:
        return rules
    rules = [dataclasses.replace(rule, mixer="attention") for rule in rules]
    return rules + list(gated_delta_net_rules(fam.linear_attention.module))


def linear_layers(hf_config: PretrainedConfig) -> tuple[bool, ...]:
    """Per global layer, whether it is a Gated DeltaNet (linear attention) layer (the family's
    `LinearAttention.layers` rule; all ``False`` without). Raises ``ValueError`` for an unknown
    family."""
    linear = megatron_family(hf_config).linear_attention
    chosen = set(linear.layers(hf_config)) if linear else set()
    return tuple(i in chosen for i in range(hf_config.num_hidden_layers))


def megatron_family(hf_config: PretrainedConfig) -> Family:
    """The row of `hf_config`'s family, when megatron-core can build it.

    Raises ``ValueError`` for an unknown family (naming the known ones), and for a family the
    transformers backend trains but megatron-core cannot express, with the row's reason.
    """
    row = family(hf_config)
    if row.megatron is not None:
        raise ValueError(
            f"model family {row.name!r} is supported by the transformers backend but not by "
            f"megatron: {row.megatron}. Use backend='transformers' for it."
        )
    return row


def rules_for(hf_config: PretrainedConfig, head: str = "lm") -> list[Rule]:
    """The bridge table of `hf_config`'s family, in HF checkpoint order.

    Optional rows (biases, q/k norms, MoE, tied or separate output layer) follow the family's
    row (`twinkle_fn.models.families`) and the config. `head` ``"value"`` (a critic) ends with
    the value head's ``score`` rows instead of the output layer's. Raises ``ValueError`` as
    `megatron_family`, and for a `head` outside `HEADS`.
    """
    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}; use one of {', '.join(HEADS)}")
    fam = megatron_family(hf_config)
    rules = [EMBEDDING, INPUT_NORM, *attention_rules(hf_config)]
    rules += [POST_ATTN_NORM, *MLP]
    rules += MLP_BIAS if fam.has_bias("mlp", hf_config) else ()
    rules += moe_rules(fam.moe) if fam.moe is not None else ()
    rules += [FINAL_NORM]
    if head == "value":
        rules += [VALUE_HEAD, VALUE_BIAS] if value_bias(hf_config) else [VALUE_HEAD]
    else:
        rules += [TIED_LM_HEAD if hf_config.tie_word_embeddings else LM_HEAD]
    return rules


def moe_layers(hf_config: PretrainedConfig) -> tuple[bool, ...]:
    """Per global layer, whether it is a routed-MoE layer (the family's `Moe.layers` rule).

    Dense families give all ``False``. Raises ``ValueError`` for an unknown family.
    """
    moe = set(megatron_family(hf_config).moe_layers(hf_config))
    return tuple(i in moe for i in range(hf_config.num_hidden_layers))


def mla_split_rows(hf_config: PretrainedConfig) -> tuple[tuple[str, int], ...]:
    """The rows of multi-latent attention's down projections, which tp splits, by the config
    fields that size them."""
    kv = ("kv_lora_rank + qk_rope_head_dim", hf_config.kv_lora_rank + hf_config.qk_rope_head_dim)
    q_rank = hf_config.q_lora_rank
    return (kv,) if q_rank is None else (("q_lora_rank", q_rank), kv)
