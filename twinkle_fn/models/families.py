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

1. Its `Family` row (the type: ``_family_row.py``) in the module of its kind:
   ``_dense_rows.py``, ``_moe_rows.py`` or ``_hybrid_rows.py`` beside this one, listed in
   `_ROWS` here; a rule its row names that reads the HF config (which layers are MoE...) in
   ``_layer_rules.py``. Every field is required; `families_test.py` checks each against the
   model transformers builds (plan entries are real linears, biases and q/k norms exist exactly
   where the row says, the window field windows attention...) and ``_layer_rules_test.py`` that
   the MoE-layer rule matches the layers that have experts.
2. ``twinkle_fn/testing/configs.py``: its tiny config in ``_EXTRA`` (2 layers, hidden 32:
   seconds on a CPU). This puts it under the conformance suite, ``tests/test_family_conformance.py``, and
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

To try a row without editing the table, `registered(row)` makes it known inside a ``with``
block only (``families_test.py`` trains a copy of qwen2 under another ``model_type`` that way).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from types import MappingProxyType

from transformers import PretrainedConfig

from twinkle_fn.models._dense_rows import GEMMA3_TEXT, LLAMA, MISTRAL, QWEN2, QWEN3
from twinkle_fn.models._family_row import (
    BIAS_PARTS,
    COLWISE,
    ROPE_KINDS,
    ROUTER_SCORES,
    ROWWISE,
    TP_STYLES,
    Family,
    Flag,
    LinearAttention,
    Moe,
    SharedExpert,
    flag_on,
)
from twinkle_fn.models._hybrid_rows import QWEN3_5_MOE_TEXT, QWEN3_5_TEXT
from twinkle_fn.models._layer_rules import (
    after_first_k_dense,
    every_layer,
    n_shared_experts_ffn,
    sparse_step_moe_layers,
    typed_layers,
)
from twinkle_fn.models._moe_rows import DEEPSEEK_V3, GLM4_MOE, MIXTRAL, QWEN2_MOE, QWEN3_MOE

__all__ = [
    "BIAS_PARTS",
    "COLWISE",
    "FAMILIES",
    "ROPE_KINDS",
    "ROUTER_SCORES",
    "ROWWISE",
    "TEXT_CONFIGS",
    "TP_STYLES",
    "Family",
    "Flag",
    "LinearAttention",
    "Moe",
    "SharedExpert",
    "after_first_k_dense",
    "every_layer",
    "family",
    "family_of",
    "flag_on",
    "known",
    "n_shared_experts_ffn",
    "registered",
    "sparse_step_moe_layers",
    "typed_layers",
]

# The table, in the order `FAMILIES` lists the families (error messages and tests follow it).
_ROWS = (
    LLAMA,
    MISTRAL,
    QWEN2,
    QWEN3,
    QWEN3_MOE,
    QWEN2_MOE,
    MIXTRAL,
    GLM4_MOE,
    DEEPSEEK_V3,
    QWEN3_5_TEXT,
    QWEN3_5_MOE_TEXT,
    GEMMA3_TEXT,
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
