import warnings

import pytest
import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

from twinkle_fn.backends.megatron import spec
from twinkle_fn.backends.megatron.attention import SDPAAttention
from twinkle_fn.backends.megatron.attention_test import _config
from twinkle_fn.backends.megatron.config import transformer_config
from twinkle_fn.backends.megatron.gated_delta_net import GatedDeltaNet
from twinkle_fn.backends.megatron.grouped_experts import GroupedSequentialMLP
from twinkle_fn.backends.megatron.spec import RMSNorm, decoder_spec, layer_spec
from twinkle_fn.mesh import Mesh
from twinkle_fn.testing import tiny_config


def test_rms_norm_matches_transformers_and_marks_sequence_parallel():
    x = torch.randn(5, 2, 16)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        norm = RMSNorm(_config(params_dtype=dtype), 16, eps=1e-5)
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
        ref = LlamaRMSNorm(16, eps=1e-5).to(dtype)
        ref.load_state_dict(norm.state_dict())
        xd = x.to(dtype)
        torch.testing.assert_close(norm(xd), ref(xd), rtol=tol, atol=tol)
    assert list(dict(norm.named_parameters())) == ["weight"]
    assert not norm.weight.sequence_parallel
    sp = _config(tensor_model_parallel_size=2, sequence_parallel=True)
    assert RMSNorm(sp, 16).weight.sequence_parallel
    with pytest.raises(ValueError, match="normalization='LayerNorm'"):
        RMSNorm(_config(normalization="LayerNorm"), 16)


def test_the_compiled_norm_past_dynamo_s_recompile_limit_runs_eager_instead_of_raising():
    """One compiled norm serves every model in the process; past dynamo's recompile limit (here
    1, by default 8: a GPU test session reached it) a new eps runs the eager norm, same values."""
    x, w = torch.randn(3, 8), torch.rand(8)
    with torch._dynamo.config.patch(recompile_limit=1):
        for eps in (1e-5, 1e-6, 1e-4):
            got = spec._compiled_rms_norm()(x, w, eps)
            torch.testing.assert_close(got, spec.rms_norm(x, w, eps), rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the norm is compiled on CUDA only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_rms_norm_matches_the_eager_one_forward_and_backward(dtype):
    """Same ops, fused: the float32 statistics differ in summation order only (fp32: 1e-5),
    and bf16 outputs may round the other way where that moves a value across a rounding
    boundary (one bf16 ulp, 8e-3 relative); the gradients sum many such terms: 1e-2 of their
    norm."""
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    x = torch.randn(64, 3, 2, 16, device="cuda", dtype=dtype)  # [s, b, heads, dim] (q/k norm)
    grad = torch.randn_like(x)
    outs = {}
    for fused in (True, False):
        norm = RMSNorm(_config(params_dtype=dtype, persist_layer_norm=fused), 16, eps=1e-5)
        norm = norm.cuda()
        with torch.no_grad():
            norm.weight.copy_(torch.linspace(0.5, 1.5, 16))
        xi = x.clone().requires_grad_()
        out = norm(xi)
        out.backward(grad)
        outs[fused] = (out.detach(), xi.grad, norm.weight.grad)
        assert norm.fused == fused
    torch.testing.assert_close(outs[True][0], outs[False][0], rtol=tol, atol=tol)
    for got, want in zip(outs[True][1:], outs[False][1:], strict=True):
        assert got.dtype == want.dtype == dtype
        assert (got.float() - want.float()).norm() <= max(tol, 1e-2) * want.float().norm()


def test_layer_spec_uses_sdpa_rms_norm_and_the_moe_layer_where_asked():
    dense = layer_spec(_config(qk_layernorm=True), use_te=False)
    attn = dense.submodules.self_attention.submodules
    assert attn.core_attention is SDPAAttention and attn.q_layernorm is RMSNorm
    assert attn.linear_proj is spec.RowParallelLinear
    assert dense.submodules.mlp.keywords["submodules"].linear_fc2 is spec.RowParallelLinear
    assert dense.submodules.input_layernorm is RMSNorm
    assert layer_spec(_config(), use_te=None).submodules.self_attention.submodules.k_layernorm is (
        IdentityOp
    )
    moe_cfg = _config(num_moe_experts=4, moe_ffn_hidden_size=8, moe_layer_freq=[0, 1])
    assert layer_spec(moe_cfg).submodules.mlp.func is MoELayer
    assert layer_spec(moe_cfg, moe=False).submodules.mlp.func is not MoELayer
    experts = layer_spec(moe_cfg).submodules.mlp.keywords["submodules"].experts
    assert experts.func is GroupedSequentialMLP
    looped = layer_spec(moe_cfg, grouped_experts=False).submodules.mlp.keywords["submodules"]
    assert looped.experts.func is SequentialMLP
    assert looped.experts.keywords == experts.keywords  # the same linears: the same parameters
    with pytest.raises(ValueError, match="TransformerEngine is not importable"):
        layer_spec(_config(), use_te=True)


def test_row_parallel_linear_hands_its_group_to_the_matmul(megatron_world):
    layer = spec.RowParallelLinear(
        8,
        4,
        config=_config(),
        init_method=torch.nn.init.normal_,
        bias=False,
        input_is_parallel=True,
        skip_bias_add=True,
    )
    x = torch.randn(3, 2, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, _ = layer(x)
    # megatron-core's own class warns here in every forward (and breaks torch.compile's graph)
    assert not [w for w in caught if "tp_group is None" in str(w.message)]
    torch.testing.assert_close(out, x @ layer.weight.t())


def test_fused_norm_linears_are_never_used(monkeypatch):
    """A backend like TE's offers LayerNorm+fc1 in one module: the spec keeps them apart."""

    class FusedNormLinear:
        pass

    class Fusing(spec._SDPASpecProvider):
        def fuse_layernorm_and_linear(self):
            return True

        def column_parallel_layer_norm_linear(self):
            return FusedNormLinear

    monkeypatch.setattr(spec, "_backend", lambda use_te, grouped_experts: Fusing())
    layer = layer_spec(_config(), use_te=True).submodules
    assert layer.mlp.keywords["submodules"].linear_fc1 is ColumnParallelLinear
    assert layer.self_attention.submodules.linear_qkv is ColumnParallelLinear
    assert layer.pre_mlp_layernorm is RMSNorm and layer.input_layernorm is RMSNorm


def test_decoder_spec_holds_this_stages_layers_and_a_final_rms_norm():
    moe_cfg = _config(
        num_layers=4,
        num_moe_experts=4,
        moe_ffn_hidden_size=8,
        moe_layer_freq=[1, 0, 0, 1],
        pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
    )
    kinds = [
        [s.submodules.mlp.func is MoELayer for s in decoder_spec(moe_cfg, pp_rank=r).layer_specs]
        for r in (0, 1)
    ]
    assert kinds == [[True, False], [False, True]]
    assert decoder_spec(moe_cfg, pp_rank=0).layer_norm is RMSNorm


def test_qwen3_5_layers_and_centred_norms():
    """Qwen3.5's block: a Gated DeltaNet layer (twinkle's GatedDeltaNet, its gated output norm
    a plain `HeadRMSNorm`) then an attention layer, on the SDPA spec; TE is refused for it. Its
    (1 + weight) norms start at zero and equal transformers' Qwen3.5 RMSNorm."""
    config = transformer_config(tiny_config("qwen3_5_text"), Mesh())
    block = decoder_spec(config, use_te=None, pp_rank=0)
    linear, full = (s.submodules.self_attention for s in block.layer_specs)
    assert linear.module is GatedDeltaNet and linear.submodules.out_norm is spec.HeadRMSNorm
    assert full.module is spec.SelfAttention
    with pytest.raises(ValueError, match="use_te=True: twinkle's TransformerEngine spec"):
        decoder_spec(config, use_te=True, pp_rank=0)
    norm = RMSNorm(config, 32, eps=1e-6)
    assert norm.zero_centered and not norm.weight.any()
    want = Qwen3_5RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
        want.weight.copy_(norm.weight)
    x = torch.randn(3, 32)
    torch.testing.assert_close(norm(x), want(x), rtol=0, atol=1e-6)
