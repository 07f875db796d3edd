"""The HF <-> megatron-core bridge (`hf_to_mcore`, `mcore_to_hf`) on every family megatron-core
builds and their variants: the round trip on every (tp, pp, ep, etp) layout is bit-exact, each
rank's shapes are megatron's formula, vocabulary padding rows are zero and a tied output is the
embedding, and expert tensor parallelism follows real mesh coordinates. The names and shapes of
megatron-core's own GPTModel, and logits through twinkle's GPT model, are
``bridge_mcore_test``'s. The per-case checkpoints are the fixture ``checkpoints`` of
``conftest.py``, shared with it."""

import itertools

import pytest
import torch

from twinkle_fn.backends.megatron.bridge import (
    hf_to_mcore,
    mcore_to_hf,
)
from twinkle_fn.backends.megatron.bridge_transforms import padded_vocab_size
from twinkle_fn.mesh import Mesh
from twinkle_fn.models.families import FAMILIES, family
from twinkle_fn.testing import tiny_config

# The families megatron-core builds (the others are refused: config_test).
BUILT = tuple(name for name in FAMILIES if family(name).megatron is None)

# Variants beyond the plain tiny configs: tied embeddings (the pp > 1 output copy), a head_dim
# that is not hidden / heads, every llama bias, one kv head under tp=2 (megatron replicates kv
# heads), and a Qwen3-MoE with a dense layer.
CASES = {
    **{family: {} for family in BUILT},
    "qwen2-tied": {"tie_word_embeddings": True},
    "qwen3-hd16": {"head_dim": 16},
    "llama-bias": {"attention_bias": True, "mlp_bias": True},
    "mistral-kv1": {"num_key_value_heads": 1},
    "qwen3_moe-mixed": {"mlp_only_layers": [1]},
    "deepseek_v3-q_proj": {"q_lora_rank": None},
}


_MOE = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3")
# routers with an expert bias and ungated shared experts
_GLM_MOE = ("glm4_moe", "deepseek_v3")


def _config(case):
    return tiny_config(case.split("-")[0], **CASES[case])


def _all_ranks(state, cfg, tp, pp, ep, **kw):
    return {
        (t, p, e): hf_to_mcore(
            state, cfg, tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp, ep_rank=e, ep_size=ep, **kw
        )
        for t, p, e in itertools.product(range(tp), range(pp), range(ep))
    }


def _meshes(case):
    # (tp, pp, ep, etp): MoE models also split experts over ep and, with etp = tp, within them.
    if _config(case).model_type not in _MOE:
        return [(case, tp, pp, 1, 1) for tp, pp in itertools.product((1, 2), (1, 2))]
    grid = itertools.product((1, 2), (1, 2), (1, 2), (1, 2))
    return [(case, tp, pp, ep, etp) for tp, pp, ep, etp in grid if etp in (1, tp)]


@pytest.mark.parametrize(
    ("case", "tp", "pp", "ep", "etp"), [m for case in CASES for m in _meshes(case)]
)
def test_round_trip_is_bit_exact(checkpoints, case, tp, pp, ep, etp):
    cfg, state = checkpoints[case]
    local = _all_ranks(state, cfg, tp, pp, ep, etp_size=etp)
    layout = dict(tp_size=tp, pp_size=pp, ep_size=ep, etp_size=etp)
    names = [name for name, _ in mcore_to_hf(local, cfg, **layout)]
    back = dict(mcore_to_hf(local, cfg, **layout))
    assert len(names) == len(back), "a tensor was exported twice"
    assert back.keys() == state.keys()
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def _experts(cfg):
    """(experts, one expert's intermediate size) of an MoE config."""
    if cfg.model_type == "mixtral":
        return cfg.num_local_experts, cfg.intermediate_size
    if cfg.model_type in _GLM_MOE:
        return cfg.n_routed_experts, cfg.moe_intermediate_size
    return cfg.num_experts, cfg.moe_intermediate_size


def _mla_shapes(cfg, tp, prefix):
    """Multi-latent attention's shapes on one tp rank: the down projections' rows split
    (megatron builds them column-parallel), the up projections split by heads."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    q_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    kv_down = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    shapes = {
        prefix + "linear_kv_down_proj.weight": (kv_down // tp, h),
        prefix + "kv_layernorm.weight": (cfg.kv_lora_rank,),
        prefix + "linear_kv_up_proj.weight": (
            heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) // tp,
            cfg.kv_lora_rank,
        ),
        prefix + "linear_proj.weight": (h, heads * cfg.v_head_dim // tp),
    }
    if cfg.q_lora_rank is None:
        return {prefix + "linear_q_proj.weight": (heads * q_dim // tp, h), **shapes}
    return {
        prefix + "linear_q_down_proj.weight": (cfg.q_lora_rank // tp, h),
        prefix + "q_layernorm.weight": (cfg.q_lora_rank,),
        prefix + "linear_q_up_proj.weight": (heads * q_dim // tp, cfg.q_lora_rank),
        **shapes,
    }


def _expected_local_shapes(cfg, tp, pp, ep, etp, pp_rank):
    """megatron-core's GPTModel parameter shapes on one rank, from the config."""
    h, v = cfg.hidden_size, padded_vocab_size(cfg.vocab_size, tp)
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or h // heads
    qkv_rows = (heads + 2 * kv) * hd // tp
    shapes = {}
    if pp_rank == 0:
        shapes["embedding.word_embeddings.weight"] = (v // tp, h)
    per = cfg.num_hidden_layers // pp
    for i in range(per):
        m = f"decoder.layers.{i}."
        shapes[m + "input_layernorm.weight"] = (h,)
        shapes[m + "pre_mlp_layernorm.weight"] = (h,)
        types = getattr(cfg, "layer_types", None) or ()
        if types and types[pp_rank * per + i] == "linear_attention":  # Qwen3.5's Gated DeltaNet
            f, x = cfg.intermediate_size, m + "self_attention."
            qk = cfg.linear_num_key_heads * cfg.linear_key_head_dim
            vd, nv = (
                cfg.linear_num_value_heads * cfg.linear_value_head_dim,
                cfg.linear_num_value_heads,
            )
            shapes[x + "in_proj.weight"] = ((2 * qk + 2 * vd + 2 * nv) // tp, h)
            shapes[x + "conv1d.weight"] = ((2 * qk + vd) // tp, 1, cfg.linear_conv_kernel_dim)
            shapes[x + "dt_bias"] = shapes[x + "A_log"] = (nv // tp,)
            shapes[x + "out_norm.weight"] = (cfg.linear_value_head_dim,)
            shapes[x + "out_proj.weight"] = (h, vd // tp)
            shapes[m + "mlp.linear_fc1.weight"] = (2 * f // tp, h)
            shapes[m + "mlp.linear_fc2.weight"] = (h, f // tp)
            continue
        if family(cfg.model_type).latent_attention:
            shapes.update(_mla_shapes(cfg, tp, m + "self_attention."))
        else:
            # Qwen3.5's q_proj holds an output gate
            gate_rows = heads * hd // tp if cfg.model_type == "qwen3_5_text" else 0
            shapes[m + "self_attention.linear_qkv.weight"] = (qkv_rows + gate_rows, h)
        if cfg.model_type in ("qwen2", "qwen2_moe"):
            shapes[m + "self_attention.linear_qkv.bias"] = (qkv_rows,)
        if cfg.model_type.startswith("qwen3"):
            shapes[m + "self_attention.q_layernorm.weight"] = (hd,)
            shapes[m + "self_attention.k_layernorm.weight"] = (hd,)
        if not family(cfg.model_type).latent_attention:
            shapes[m + "self_attention.linear_proj.weight"] = (h, heads * hd // tp)
        # GLM-4 MoE begins with first_k_dense_replace dense layers
        first_moe = getattr(cfg, "first_k_dense_replace", 0)
        if cfg.model_type in _MOE and pp_rank * per + i >= first_moe:
            e, f = _experts(cfg)
            shapes[m + "mlp.router.weight"] = (e, h)
            for j in range(e // ep):
                x = f"{m}mlp.experts.local_experts.{j}."
                shapes[x + "linear_fc1.weight"] = (2 * f // etp, h)
                shapes[x + "linear_fc2.weight"] = (h, f // etp)
            if cfg.model_type == "qwen2_moe":  # the shared expert: split over tp, gate whole
                s, x = cfg.shared_expert_intermediate_size, f"{m}mlp.shared_experts."
                shapes[x + "linear_fc1.weight"] = (2 * s // tp, h)
                shapes[x + "linear_fc2.weight"] = (h, s // tp)
                shapes[x + "gate_weight"] = (1, h)
            if cfg.model_type in _GLM_MOE:  # shared experts, no gate; the router's bias
                s, x = cfg.moe_intermediate_size * cfg.n_shared_experts, f"{m}mlp.shared_experts."
                shapes[x + "linear_fc1.weight"] = (2 * s // tp, h)
                shapes[x + "linear_fc2.weight"] = (h, s // tp)
                shapes[m + "mlp.router.expert_bias"] = (e,)
        else:
            f = cfg.intermediate_size
            shapes[m + "mlp.linear_fc1.weight"] = (2 * f // tp, h)
            shapes[m + "mlp.linear_fc2.weight"] = (h, f // tp)
    if pp_rank == pp - 1:
        shapes["decoder.final_layernorm.weight"] = (h,)
        if not cfg.tie_word_embeddings or pp_rank > 0:
            shapes["output_layer.weight"] = (v // tp, h)
    return shapes


@pytest.mark.parametrize(
    ("case", "etp"), [*((c, 1) for c in (*BUILT, "qwen2-tied", "qwen3-hd16")), ("qwen3_moe", 2)]
)
def test_local_shapes_match_megatron_formula(checkpoints, case, etp):
    cfg, state = checkpoints[case]
    ep = 2 if cfg.model_type in _MOE else 1
    for (_, pp_rank, _), local in _all_ranks(state, cfg, 2, 2, ep, etp_size=etp).items():
        got = {name: tuple(t.shape) for name, t in local.items()}
        assert got == _expected_local_shapes(cfg, 2, 2, ep, etp, pp_rank)


def test_vocab_padding_rows_are_zero_and_tied_output_is_the_embedding(checkpoints):
    cfg, state = checkpoints["qwen2-tied"]
    local = _all_ranks(state, cfg, 2, 2, 1)
    embed = torch.cat([local[(t, 0, 0)]["embedding.word_embeddings.weight"] for t in range(2)])
    output = torch.cat([local[(t, 1, 0)]["output_layer.weight"] for t in range(2)])
    assert embed.shape[0] == 256  # 96 rounded up to a multiple of 128 * tp
    assert torch.equal(embed[:96], state["model.embed_tokens.weight"])
    assert not embed[96:].any()
    assert torch.equal(output, embed)
    assert "output_layer.weight" not in local[(0, 0, 0)]


def _mesh_states(state, cfg, mesh, with_etp):
    """Every rank of `mesh` as twinkle's Mesh places it: keys (tp, pp, ep[, etp])."""
    local = {}
    for rank in range(mesh.world_size):
        dense, expert = mesh.coords(rank), mesh.expert_coords(rank)
        key = (dense["tp"], dense["pp"], expert["ep"])
        local[(*key, expert["etp"]) if with_etp else key] = hf_to_mcore(
            state,
            cfg,
            tp_rank=dense["tp"],
            tp_size=mesh.tp,
            pp_rank=dense["pp"],
            pp_size=mesh.pp,
            ep_rank=expert["ep"],
            ep_size=mesh.ep,
            etp_rank=expert["etp"] if with_etp else None,
            etp_size=mesh.etp,
        )
    return local


@pytest.mark.parametrize(
    ("mesh", "with_etp"),
    [
        # etp=1 under tp=2: experts whole on every tp rank; only (tp, ep) = (0, 0), (1, 1) exist.
        (Mesh(dp=2, tp=2, ep=2, etp=1), False),
        # etp=2 under tp=1: the expert TP rank comes from the dp ranks, so keys carry it.
        (Mesh(dp=2, tp=1, ep=1, etp=2), True),
    ],
)
def test_expert_tensor_parallelism_from_real_mesh_coordinates(checkpoints, mesh, with_etp):
    cfg, state = checkpoints["qwen3_moe"]
    local = _mesh_states(state, cfg, mesh, with_etp)
    fc1 = next(iter(local.values()))[
        "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    ]
    assert fc1.shape == (2 * cfg.moe_intermediate_size // mesh.etp, cfg.hidden_size)
    layout = dict(tp_size=mesh.tp, pp_size=mesh.pp, ep_size=mesh.ep, etp_size=mesh.etp)
    back = dict(mcore_to_hf(local, cfg, **layout))
    assert back.keys() == state.keys()
    assert all(torch.equal(back[name], t) for name, t in state.items())
    if with_etp:
        with pytest.raises(ValueError, match="pass it"):
            hf_to_mcore(state, cfg, etp_size=2)
        with pytest.raises(ValueError, match="pass it"):
            mcore_to_hf({k[:3]: v for k, v in local.items()}, cfg, **layout)
