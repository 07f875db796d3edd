"""Build megatron-core's ``GPTModel`` for an HF config on this rank's pipeline stage.

megatron-core 0.19 deprecates ``GPTModel`` in favour of ``HybridModel``. Every family built
here is built on ``GPTModel`` still, Qwen3.5's hybrid layers included:

- attention-only families (dense, MoE and shared-expert MLPs, GLM-4 MoE's sigmoid router):
  ``GPTModel`` is what the layer spec, the bridge's parameter names, LoRA, dist checkpoints and
  the CPU compatibility layer are written and tested against, and it builds them exactly;
- DeepSeek-V3: every layer is attention then an MLP (dense, or MoE with shared experts),
  ``GPTModel``'s layer exactly with megatron's ``MLASelfAttention`` as its attention
  (`twinkle_fn.backends.megatron.mla`; ``GPTModel`` leaves the rotary embedding to it), so its
  bridge, LoRA and checkpoints are laid out as every other family's;
- Qwen3.5 (Gated DeltaNet layers between gated attention layers, every layer followed by a
  dense MLP): its layer spec puts megatron-core's ``GatedDeltaNet`` where the attention is in
  the DeltaNet layers (`twinkle_fn.backends.megatron.spec`), with megatron's own
  ``experimental_attention_variant="gated_delta_net"`` and ``linear_attention_freq`` in the
  ``TransformerConfig`` -- megatron-core's own way of building a Qwen3-Next-style model on
  ``GPTModel``. ``HybridModel`` could express the pattern (a mixer layer, then an MLP layer,
  per HF layer), but it numbers the mixer and the MLP as two layers, so HF layer ``i`` would
  become layers ``2i`` and ``2i + 1``: the bridge, LoRA, pipeline stages (``HybridModel``
  splits its pattern string, not HF layers) and dist checkpoints would all change for this one
  family, and its stack spec is written for TransformerEngine's modules. On ``GPTModel`` one
  HF layer stays one megatron layer, with the same norms and MLP names as every family.

Moving every family to ``HybridModel`` at once, when ``GPTModel`` is removed, is then one
change of numbering in the bridge rather than a fork per family.

A critic (``head="value"``) is the same ``GPTModel`` with its vocabulary output layer replaced by
`ValueHead`, a replicated ``[hidden] -> 1`` linear: the way verl / slime build a megatron critic
(their ``LinearForLastLayer``), which keeps the decoder, the bridge, the pipeline schedule and
dist checkpoints of the causal LM unchanged; only the last stage's output differs.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer import TransformerConfig
from torch import Tensor
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from twinkle_fn.backends.megatron.bridge_transforms import padded_vocab_size
from twinkle_fn.backends.megatron.config import transformer_config
from twinkle_fn.backends.megatron.spec import decoder_spec
from twinkle_fn.mesh import Mesh

# Rope types whose HF inverse frequencies are the whole story (no attention scaling, no
# sequence-length-dependent update): megatron's rotary module takes them as they are.
_STATIC_ROPE_TYPES = ("default", "linear", "llama3")


def rope_settings(hf_config: PretrainedConfig) -> tuple[float, str]:
    """``(rope_theta, rope_type)`` of `hf_config` (transformers 5 ``rope_parameters`` or 4.x)."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        scaling = getattr(hf_config, "rope_scaling", None) or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        return float(getattr(hf_config, "rope_theta", 10000.0)), kind
    return float(params["rope_theta"]), params.get("rope_type", "default")


def rotary_fraction(hf_config: PretrainedConfig) -> float:
    """The fraction of each head's channels that rotary embeddings rotate (the first ones;
    ``partial_rotary_factor`` of ``rope_parameters`` or of the config, 1.0 when unset)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return float(
        params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    )


def _check_mesh_matches_megatron(mesh: Mesh) -> None:
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "megatron-core's parallel state is not initialized; call "
            "twinkle_fn.backends.megatron.parallel.initialize(mesh) before building a model"
        )
    live = dict(
        tp=parallel_state.get_tensor_model_parallel_world_size(),
        pp=parallel_state.get_pipeline_model_parallel_world_size(),
        cp=parallel_state.get_context_parallel_world_size(),
        ep=parallel_state.get_expert_model_parallel_world_size(),
        etp=parallel_state.get_expert_tensor_parallel_world_size(),
    )
    for axis, size in live.items():
        if getattr(mesh, axis) != size:
            raise ValueError(
                f"mesh {axis}={getattr(mesh, axis)} but megatron-core was initialized with "
                f"{axis}={size}; build the model with the mesh passed to initialize()"
            )


class ValueHead(torch.nn.Linear):
    """A critic's output layer: one value per token, ``[hidden] -> 1`` with a bias, replicated
    on every tensor-parallel rank (one output cannot be split), in place of ``GPTModel``'s
    vocab-parallel ``output_layer`` (and called like it).

    Without sequence parallelism every tp rank holds the whole hidden states, computes the same
    values and the same (whole) weight gradient, and hands the decoder the whole gradient of
    its hidden states (which the decoder's row-parallel output already holds replicated): no
    reduction. With it, each rank holds its sequence shard: it computes that shard's values,
    which are all-gathered (backward: each rank keeps its shard's gradient), so the head's
    gradient is this shard's part; the weight and bias are marked ``sequence_parallel`` for
    ``finalize_model_grads`` to sum them over the tp group, as megatron does for its norms.
    """

    def __init__(self, config: TransformerConfig, *, bias: bool = True) -> None:
        super().__init__(config.hidden_size, 1, bias=bias, dtype=config.params_dtype)
        self.sequence_parallel = config.sequence_parallel
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]

    def forward(  # type: ignore[override]
        self, input_: Tensor, weight: Tensor | None = None, runtime_gather_output: Any = None
    ) -> tuple[Tensor, None]:
        """``(values, None)`` like megatron's output layer: `input_` ``[s, b, hidden]`` (this
        rank's sequence shard under sequence parallelism) -> ``[S, b, 1]`` (the whole
        sequence). `weight` must be None: a critic's head is never tied to the embedding."""
        if weight is not None:
            raise ValueError("a value head has its own weight; it cannot be tied to an embedding")
        values = super().forward(input_)
        if self.sequence_parallel:
            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None


def build_gpt_model(
    hf_config: PretrainedConfig,
    mesh: Mesh,
    *,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    use_te: bool | None = None,
    grouped_experts: bool = True,
    vocab_multiple: int = 128,
    head: str = "lm",
    value_bias: bool = True,
    **overrides: Any,
) -> GPTModel:
    """This rank's ``GPTModel`` stage for `hf_config` (randomly initialised, CPU-initialised).

        `pre_process` / `post_process` (embedding / output layer on this stage) default to whether
        this is megatron's first / last pipeline stage. Rotary embeddings follow the HF config
        (``rope_theta``; ``linear`` and ``llama3`` scaling use HF's own inverse frequencies); the
        vocabulary is padded to a multiple of ``vocab_multiple * tp``; embeddings are tied iff
        ``tie_word_embeddings``. `use_te` picks the layer spec and `grouped_experts` its MoE experts
    (grouped GEMMs or megatron's loop, see `spec.layer_spec`); `overrides`
        (``params_dtype``, ``bf16``, any ``TransformerConfig`` field) go to `transformer_config`.
        The model is moved to the current CUDA device when there is one. Logits are
        ``[batch, seq, padded_vocab]`` (vocab split over tp). `head` ``"value"`` builds a critic:
        the last stage's output layer is a `ValueHead` (with a bias iff `value_bias`) and the
        embeddings are never tied.

        Raises ``RuntimeError`` if megatron-core's parallel state is not initialized, and
        ``ValueError`` if `mesh` differs from it, for an unsupported rope type, or as
        `transformer_config` does.
    """
    _check_mesh_matches_megatron(mesh)
    config = transformer_config(hf_config, mesh, **overrides)
    theta, rope_type = rope_settings(hf_config)
    # multi-latent attention rotates in its own attention module (`mla.mla_fields`)
    latent = config.multi_latent_attention
    if rope_type not in _STATIC_ROPE_TYPES and not latent:
        raise ValueError(
            f"rope_type={rope_type!r} is not supported; use one of {', '.join(_STATIC_ROPE_TYPES)}"
        )
    first = parallel_state.is_pipeline_first_stage() if pre_process is None else pre_process
    last = parallel_state.is_pipeline_last_stage() if post_process is None else post_process
    model = GPTModel(
        config=config,
        transformer_layer_spec=decoder_spec(config, use_te, grouped_experts=grouped_experts),
        vocab_size=padded_vocab_size(hf_config.vocab_size, mesh.tp, vocab_multiple),
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=first,
        post_process=last,
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings) and head == "lm",
        position_embedding_type="rope",
        rotary_base=theta,
        rotary_percent=rotary_fraction(hf_config),
    )
    if rope_type != "default" and not latent:
        inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
        model.rotary_pos_emb.inv_freq = inv_freq.float()
    if head == "value" and last:
        model.output_layer = ValueHead(config, bias=value_bias)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model
