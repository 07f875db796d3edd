"""The HF <-> megatron-core weight bridge, as data: one table of `Rule` rows per model family.

A rule names HF tensors (the on-disk checkpoint names that ``from_pretrained`` loads, e.g.
per-expert ``mlp.experts.{expert}.gate_proj.weight`` for Qwen3-MoE), the megatron-core tensor
they become (the names of megatron-core's GPT layer spec), the transform between them and the dim
that tensor parallelism splits. This module gathers the bridge's public names; the parts:

- `twinkle_fn.backends.megatron.bridge_rules`: the tables (`Rule`, `rules_for`);
- `twinkle_fn.backends.megatron.bridge_layout`: the sizes they are laid out over, checked, and a
  table expanded into one stage's tensors;
- `twinkle_fn.backends.megatron.bridge_transforms`: the tensor transforms (fusing, splitting,
  vocabulary padding);
- `twinkle_fn.backends.megatron.bridge_to_mcore`: `hf_to_mcore` builds one rank's local state,
  reading only that rank's slices when the source supports partial reads (`SliceSource`, e.g.
  `twinkle_fn.backends.megatron.safetensors_io.SafetensorsReader`);
- `twinkle_fn.backends.megatron.bridge_to_hf`: `mcore_to_hf` streams full HF tensors from every
  rank's local state, layer by layer; `export_buckets` (`twinkle_fn.backends.buckets.buckets`,
  the bucketing every export uses) groups that stream into size-bounded lists for saving or for
  an inference engine.

Layout conventions (megatron-core's): decoder layers are numbered locally per pipeline stage,
stage ``s`` holding global layers ``[s * L / pp, (s + 1) * L / pp)``; the embedding lives on the
first stage, the final norm and output layer on the last. With tied embeddings megatron-core
keeps a copy of the embedding as ``output_layer.weight`` on the last stage when ``pp > 1``: it
is imported there and never exported. Experts are numbered locally per expert-parallel rank
(global expert ``= ep_rank * E / ep + j``) and split within an expert over the expert-tensor-
parallel size ``etp`` (twinkle's `Mesh` default is 1; megatron-core's own default is the TP size).
"""

from twinkle_fn.backends.buckets import buckets as export_buckets
from twinkle_fn.backends.megatron.bridge_rules import (
    EMBEDDING,
    FINAL_NORM,
    INPUT_NORM,
    LAYER_KINDS,
    LM_HEAD,
    MLP,
    MLP_BIAS,
    O_BIAS,
    O_PROJ,
    POST_ATTN_NORM,
    QK_NORM,
    QKV,
    QKV_BIAS,
    STAGES,
    TIED_LM_HEAD,
    TRANSFORMS,
    VALUE_BIAS,
    VALUE_HEAD,
    Rule,
    moe_layers,
    moe_rules,
    rules_for,
)
from twinkle_fn.backends.megatron.bridge_to_hf import LocalStates, join_shards, mcore_to_hf
from twinkle_fn.backends.megatron.bridge_to_mcore import (
    HFState,
    SliceSource,
    hf_to_mcore,
    iter_hf_to_mcore,
)

__all__ = [
    "EMBEDDING",
    "FINAL_NORM",
    "INPUT_NORM",
    "LAYER_KINDS",
    "LM_HEAD",
    "MLP",
    "MLP_BIAS",
    "O_BIAS",
    "O_PROJ",
    "POST_ATTN_NORM",
    "QKV",
    "QKV_BIAS",
    "QK_NORM",
    "STAGES",
    "TIED_LM_HEAD",
    "TRANSFORMS",
    "VALUE_BIAS",
    "VALUE_HEAD",
    "HFState",
    "LocalStates",
    "Rule",
    "SliceSource",
    "export_buckets",
    "hf_to_mcore",
    "iter_hf_to_mcore",
    "join_shards",
    "mcore_to_hf",
    "moe_layers",
    "moe_rules",
    "rules_for",
]
