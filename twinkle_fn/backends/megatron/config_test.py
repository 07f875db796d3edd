import dataclasses

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig

import twinkle_fn as tf
from twinkle_fn.backends.megatron import train
from twinkle_fn.backends.megatron.bridge_transforms import padded_vocab_size
from twinkle_fn.backends.megatron.config import transformer_config
from twinkle_fn.backends.megatron.placement import model_placement
from twinkle_fn.data import pack
from twinkle_fn.mesh import Mesh
from twinkle_fn.models import FAMILIES, family, registered
from twinkle_fn.testing import random_features, tiny_config

_FUSIONS = ("bias_activation_fusion", "bias_dropout_fusion", "persist_layer_norm")


@pytest.mark.parametrize("family", [f for f in FAMILIES if family(f).megatron is None])
def test_architecture_fields_follow_the_hf_config(family):
    hf = tiny_config(family, num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-5)
    cfg = transformer_config(hf, Mesh())
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size) == (2, 32, hf.intermediate_size)
    if tf.models.family(family).latent_attention:  # every head its own keys (`mla_test`)
        assert (cfg.num_attention_heads, cfg.num_query_groups) == (8, 8)
        assert cfg.kv_channels == hf.qk_nope_head_dim + hf.qk_rope_head_dim
    else:
        assert (cfg.num_attention_heads, cfg.num_query_groups) == (8, 2)
        head_dim_8 = ("qwen3", "qwen3_moe", "glm4_moe", "qwen3_5_text")
        assert cfg.kv_channels == (8 if family in head_dim_8 else 32 // 8)
    assert cfg.normalization == "RMSNorm" and cfg.layernorm_epsilon == 1e-5
    assert cfg.gated_linear_unit and cfg.activation_func is F.silu
    assert not cfg.add_bias_linear
    assert cfg.add_qkv_bias == (family in ("qwen2", "qwen2_moe"))
    assert cfg.qk_layernorm == (family in ("qwen3", "qwen3_moe", "qwen3_5_text"))
    assert cfg.hidden_dropout == 0.0 and cfg.attention_dropout == 0.0
    assert cfg.use_cpu_initialization and not cfg.gradient_accumulation_fusion
    assert cfg.calculate_per_token_loss and cfg.variable_seq_lengths
    assert cfg.moe_token_dispatcher_type == "alltoall"
    assert cfg.params_dtype == torch.float32 and not cfg.bf16
    moe = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3")
    assert (cfg.num_moe_experts is not None) == (family in moe)
    shared = cfg.moe_shared_expert_intermediate_size
    assert (shared is not None) == (family in ("qwen2_moe", "glm4_moe", "deepseek_v3"))


def test_a_family_megatron_cannot_express_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="'gemma3_text' is supported by the transformers") as err:
        transformer_config(tiny_config("gemma3_text"), Mesh())
    assert "pre/post-feedforward norms" in str(err.value)
    assert "backend='transformers'" in str(err.value)


def test_qwen3_head_dim_is_not_hidden_over_heads():
    cfg = transformer_config(tiny_config("qwen3", head_dim=16), Mesh())
    assert cfg.kv_channels == 16


def test_moe_fields_and_router_normalisation():
    hf = tiny_config("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[1])
    cfg = transformer_config(hf, Mesh(ep=1))
    assert cfg.num_moe_experts == 4 and cfg.moe_router_topk == 2
    assert cfg.moe_ffn_hidden_size == 16 and cfg.ffn_hidden_size == 64
    assert cfg.moe_layer_freq == [1, 0, 1, 1]
    assert not cfg.moe_grouped_gemm and cfg.moe_router_load_balancing_type == "none"
    # norm_topk_prob=False: HF keeps the full-softmax weights of the top k (pre-softmax).
    assert cfg.moe_router_pre_softmax
    normed = transformer_config(tiny_config("qwen3_moe", norm_topk_prob=True), Mesh())
    assert not normed.moe_router_pre_softmax and normed.moe_layer_freq == 1
    sparse_step = transformer_config(
        tiny_config("qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2), Mesh()
    )
    assert sparse_step.moe_layer_freq == [0, 1, 0, 1]


def test_shared_experts_and_always_renormalised_routing():
    """Qwen2-MoE's shared expert with its sigmoid gate; Mixtral renormalises its top k always
    (megatron: a softmax over the top-k logits) and has experts of intermediate_size."""
    qwen = transformer_config(tiny_config("qwen2_moe"), Mesh())
    assert qwen.moe_shared_expert_intermediate_size == 32 and qwen.moe_shared_expert_gate
    assert qwen.moe_ffn_hidden_size == 16 and qwen.moe_router_pre_softmax
    mixtral = transformer_config(tiny_config("mixtral", num_hidden_layers=4), Mesh())
    assert mixtral.num_moe_experts == 4 and mixtral.moe_ffn_hidden_size == 16
    assert not mixtral.moe_router_pre_softmax and mixtral.moe_layer_freq == 1
    assert mixtral.moe_shared_expert_intermediate_size is None
    with pytest.raises(ValueError, match="tp=2 does not divide the 33 shared expert"):
        transformer_config(tiny_config("qwen2_moe", shared_expert_intermediate_size=33), Mesh(tp=2))
    aux = transformer_config(
        tiny_config("qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.01), Mesh()
    )
    assert aux.moe_router_load_balancing_type == "aux_loss" and aux.moe_aux_loss_coeff == 0.01


def test_mesh_sizes_and_precision_flow_into_the_config():
    hf = tiny_config("qwen3_moe", num_hidden_layers=4)
    mesh = Mesh(tp=2, pp=2, ep=2, etp=1, sequence_parallel=True)
    cfg = transformer_config(hf, mesh, params_dtype=torch.bfloat16, bf16=True)
    assert cfg.tensor_model_parallel_size == 2 and cfg.pipeline_model_parallel_size == 2
    assert cfg.expert_model_parallel_size == 2 and cfg.expert_tensor_parallel_size == 1
    assert cfg.context_parallel_size == 1 and cfg.sequence_parallel
    assert cfg.params_dtype == torch.bfloat16 and cfg.bf16
    assert cfg.pipeline_dtype == torch.bfloat16


def test_llama_biases_and_mistral_sliding_window():
    biased = transformer_config(tiny_config("llama", attention_bias=True, mlp_bias=True), Mesh())
    assert biased.add_bias_linear and biased.add_qkv_bias
    # HF: a window of 4 tokens including the query itself.
    window = transformer_config(tiny_config("mistral", sliding_window=4), Mesh())
    assert window.window_size == (3, 0)


def test_user_overrides_win_and_unknown_names_are_refused():
    hf = tiny_config("qwen2", attention_dropout=0.1)
    assert transformer_config(hf, Mesh()).attention_dropout == 0.1
    cfg = transformer_config(
        hf, Mesh(), hidden_dropout=0.2, attention_dropout=0.0, recompute_granularity="selective"
    )
    assert cfg.hidden_dropout == 0.2 and cfg.attention_dropout == 0.0
    assert cfg.recompute_granularity == "selective"
    with pytest.raises(ValueError, match="'hiden_dropout'"):
        transformer_config(hf, Mesh(), hiden_dropout=0.2)


@pytest.mark.parametrize(
    ("hf_overrides", "mesh", "message"),
    [
        (
            {"num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 48},
            Mesh(tp=4),
            "tp=4 does not divide the 6 attention heads of this model; use a tp that divides 6",
        ),
        (
            {"num_attention_heads": 12, "num_key_value_heads": 6, "hidden_size": 48},
            Mesh(tp=4),
            "tp=4 does not divide the 6 key/value heads",
        ),
        ({"num_key_value_heads": 2}, Mesh(tp=4, sequence_parallel=False), None),
        ({"num_hidden_layers": 3}, Mesh(pp=2), "pp=2 does not divide the 3 layers"),
        ({"intermediate_size": 66}, Mesh(tp=4), "tp=4 does not divide the 66 MLP channels"),
        ({"hidden_act": "gelu"}, Mesh(), "hidden_act='gelu'"),
        ({"attention_bias": True}, Mesh(), "attention_bias=True with mlp_bias=False"),
    ],
)
def test_sizes_that_do_not_split_the_model_are_refused(hf_overrides, mesh, message):
    hf = tiny_config("llama", **hf_overrides)
    if message is None:  # fewer kv heads than tp ranks: megatron replicates them
        assert transformer_config(hf, mesh).num_query_groups == 2
        return
    with pytest.raises(ValueError, match=message):
        transformer_config(hf, mesh)


def test_expert_and_family_errors():
    with pytest.raises(ValueError, match="ep=8 does not divide the 4 experts"):
        transformer_config(tiny_config("qwen3_moe"), Mesh(dp=8, ep=8))
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        transformer_config(tiny_config("qwen2"), Mesh(dp=2, ep=2))
    with pytest.raises(ValueError, match="tp=3 is not a multiple of the 2 key/value heads"):
        transformer_config(tiny_config("llama", num_attention_heads=6, hidden_size=48), Mesh(tp=3))
    with pytest.raises(ValueError, match="unknown model family 'gpt2'"):
        transformer_config(AutoConfig.for_model("gpt2"), Mesh())


def test_padded_vocab_size_is_the_smallest_aligned_size():
    for vocab in range(1, 700, 7):
        for tp in (1, 2, 3, 4):
            for multiple in (1, 64, 128):
                size = padded_vocab_size(vocab, tp, multiple)
                step = multiple * tp
                assert size % step == 0 and vocab <= size < vocab + step
    assert padded_vocab_size(151936, 8) == 152576
    with pytest.raises(ValueError, match="tp_size must be an int >= 1"):
        padded_vocab_size(100, 0)


def test_fusions_default_on_with_cuda_and_can_be_switched_off():
    cfg = transformer_config(tiny_config("qwen2"), Mesh())
    on_cuda = torch.cuda.is_available()
    assert cfg.bias_activation_fusion == cfg.bias_dropout_fusion == on_cuda
    assert cfg.persist_layer_norm == on_cuda
    off = transformer_config(tiny_config("qwen2"), Mesh(), **dict.fromkeys(_FUSIONS, False))
    assert not any(getattr(off, name) for name in _FUSIONS)


def _loss_and_grads(hf_config, precision, fused, monkeypatch):
    """One `tf.fwd_bwd`'s loss sum and all gradients (float32, flattened in name order).

    Unfused: the config's fusions off, and the vocab-parallel loss instead of the fused one.
    """
    options = None if fused else dict.fromkeys(_FUSIONS, False)
    with monkeypatch.context() as patch:
        if not fused:
            patch.setattr(train, "fused_loss_applies", lambda *args: False)
        model = tf.models.from_hf_config(
            hf_config, seed=0, backend="megatron", precision=precision, options=options
        )
        state = tf.init(model, tf.optim.adamw(1e-3))
        config = model_placement(state.model).module.config
        assert all(getattr(config, name) == fused for name in _FUSIONS)
        grads, aux = tf.fwd_bwd(state, pack(random_features(8, seed=5)))
    flat = torch.cat([grads.params[n].detach().float().flatten() for n in sorted(grads.params)])
    return float(aux["loss_sum"]), flat.cpu()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fusions are compiled CUDA kernels")
@pytest.mark.parametrize(
    ("family", "extra"),
    [("qwen2", {}), ("llama", {"attention_bias": True, "mlp_bias": True}), ("qwen3", {})],
    ids=["qwen2", "llama-bias", "qwen3-qk-norm"],
)
def test_fused_kernels_keep_bf16_as_close_to_fp32_as_the_unfused_path(
    megatron_world, monkeypatch, family, extra
):
    """The fusions change rounding only: the compiled SwiGLU, bias-dropout-add and RMSNorm
    round once where the unfused ops round after each op, and the fused loss sums its float32
    softmax in chunks. So against the fp32 unfused reference, bf16 with fusions must be as
    accurate as bf16 without: its relative error (loss; gradients as one vector) at most twice
    the unfused one's plus 1e-3 (a quarter of a bf16 ulp), and the loss within 1e-2 relative
    (bf16's 8 significant bits over a handful of layers; on CPU the unfused bf16 loss is
    within 3e-5 and its gradients within 8e-3 of fp32's on these models)."""
    hf_config = tiny_config(family, **extra)
    ref_loss, ref = _loss_and_grads(hf_config, "fp32", False, monkeypatch)
    errors = {}
    for fused in (True, False):
        loss, grads = _loss_and_grads(hf_config, "bf16", fused, monkeypatch)
        assert loss == pytest.approx(ref_loss, rel=1e-2)
        errors[fused] = (abs(loss - ref_loss) / ref_loss, float((grads - ref).norm() / ref.norm()))
    for got, unfused in zip(errors[True], errors[False], strict=True):
        assert got <= 2 * unfused + 1e-3, errors


def test_the_family_row_is_what_the_config_reads():
    """A qwen2 copy whose row says interleaved rope, q/k norms and a window field: the config
    follows the row, not the model_type."""
    config = tiny_config("qwen2")
    config.model_type, config.sliding_window = "qwen2_copy", 4
    row = dataclasses.replace(
        family("qwen2"),
        name="qwen2_copy",
        rope="interleaved",
        qk_norm=True,
        sliding_window="sliding_window",
    )
    with registered(row):
        cfg = transformer_config(config, Mesh())
    assert cfg.rotary_interleaved and cfg.qk_layernorm and cfg.add_qkv_bias
    assert cfg.window_size == (3, 0)
    qwen2 = tiny_config("qwen2")
    qwen2.sliding_window = 4
    plain = transformer_config(qwen2, Mesh())
    assert not plain.rotary_interleaved and not plain.qk_layernorm and plain.window_size is None


def test_glm4_moe_router_is_megatrons_sigmoid_router_with_a_fixed_bias():
    """Sigmoid scores renormalised over the top k, the expert bias loaded and never moved,
    groups scored by their top 2 experts, the routed scaling factor, first dense layers."""
    hf = tiny_config("glm4_moe", num_hidden_layers=4, first_k_dense_replace=2)
    cfg = transformer_config(hf, Mesh())
    assert cfg.moe_router_score_function == "sigmoid" and cfg.moe_router_topk == 2
    assert cfg.moe_router_enable_expert_bias and cfg.moe_router_bias_update_rate == 0.0
    assert (cfg.moe_router_num_groups, cfg.moe_router_group_topk) == (2, 1)
    assert cfg.moe_router_topk_scaling_factor == 1.5
    assert cfg.moe_layer_freq == [0, 0, 1, 1] and cfg.moe_shared_expert_intermediate_size == 16
    one_group = transformer_config(tiny_config("glm4_moe", n_group=1, topk_group=1), Mesh())
    assert one_group.moe_router_num_groups is None  # one group: every expert is in it


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"norm_topk_prob": False}, "norm_topk_prob=False with a sigmoid router"),
        ({"num_experts_per_tok": 3, "topk_group": 1}, "num_experts_per_tok=3 with topk_group=1"),
    ],
)
def test_a_router_megatron_computes_otherwise_is_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        transformer_config(tiny_config("glm4_moe", **fields), Mesh())


def test_qwen3_5_gated_delta_net_layers_gate_and_centred_norms():
    """Qwen3.5's row: megatron's gated_delta_net variant on its linear_attention layers with
    the DeltaNet's sizes, the attention's output gate and (1 + weight) norms; a tp that splits
    a DeltaNet head, or cp, is refused before megatron's asserts."""
    hf = tiny_config("qwen3_5_text", num_hidden_layers=4)
    cfg = transformer_config(hf, Mesh())
    assert cfg.experimental_attention_variant == "gated_delta_net"
    assert cfg.linear_attention_freq == [1, 0, 1, 0]
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (2, 4)
    assert (cfg.linear_key_head_dim, cfg.linear_value_head_dim) == (8, 8)
    assert cfg.linear_conv_kernel_dim == 4
    assert cfg.attention_output_gate and cfg.layernorm_zero_centered_gamma
    plain = transformer_config(tiny_config("qwen3"), Mesh())
    assert plain.experimental_attention_variant is None and not plain.attention_output_gate
    assert not plain.layernorm_zero_centered_gamma
    with pytest.raises(ValueError, match="tp=4 does not divide linear_num_key_heads=2"):
        transformer_config(
            tiny_config("qwen3_5_text", num_attention_heads=8, num_key_value_heads=4), Mesh(tp=4)
        )
    with pytest.raises(ValueError, match="cp=2: context parallelism of Gated DeltaNet"):
        transformer_config(hf, Mesh(cp=2))
