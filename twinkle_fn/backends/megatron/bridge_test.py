import itertools
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from twinkle_fn.backends.megatron.bridge import (
    hf_to_mcore,
    mcore_to_hf,
    moe_layers,
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


@pytest.fixture(scope="module")
def checkpoints(hf_checkpoint):
    """Per case: the config and the tensors save_pretrained writes (the on-disk names)."""
    return {case: hf_checkpoint(case.split("-")[0], **CASES[case]) for case in CASES}


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


# One gloo process (tp=1, CPU) builds (a) megatron-core GPTModels with its own local layer spec
# from TransformerConfigs written here, for names and shapes, and (b) twinkle's build_gpt_model,
# loads a bridged save_pretrained checkpoint into it and compares its logits with HF's.
_MEGATRON_SCRIPT = textwrap.dedent(
    """
    import json, sys, tempfile
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig
    from transformers import AutoModelForCausalLM
    from twinkle_fn.backends.megatron import parallel
    from twinkle_fn.backends.megatron.attention import SDPAAttention
    from twinkle_fn.backends.megatron.bridge import hf_to_mcore
    from twinkle_fn.backends.megatron.model import build_gpt_model
    from twinkle_fn.backends.megatron.safetensors_io import SafetensorsReader
    from twinkle_fn.mesh import Mesh
    from twinkle_fn.testing import tiny_config
    parallel.initialize(Mesh())
    request = json.loads(sys.stdin.read())
    shapes = {}
    for case in request["spec"]:
        kind = MLATransformerConfig if "q_lora_rank" in case["config"] else TransformerConfig
        config = kind(
            **case["config"], activation_func=torch.nn.functional.silu, gated_linear_unit=True,
            normalization="RMSNorm", use_cpu_initialization=True,
            moe_token_dispatcher_type="allgather",
        )
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
        if config.multi_latent_attention:
            # megatron's local DotProductAttention does not take MLA's k/v channels (0.19)
            for layer in spec.layer_specs:
                layer.submodules.self_attention.submodules.core_attention = SDPAAttention
        model = GPTModel(
            config, spec, vocab_size=case["vocab_size"], max_sequence_length=64,
            pre_process=case["pre"], post_process=case["post"],
            share_embeddings_and_output_weights=case["tied"], position_embedding_type="rope",
        )
        shapes[case["id"]] = {
            k: list(v.shape) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)
        }
    logits = {}
    for case, overrides in request["twinkle"].items():
        cfg = tiny_config(case.split("-")[0], **overrides)
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(cfg).eval()
        with tempfile.TemporaryDirectory() as d:
            hf.save_pretrained(d)
            local = hf_to_mcore(SafetensorsReader(d), cfg)
        model = build_gpt_model(cfg, Mesh()).eval()
        loaded = model.load_state_dict(local, strict=False)
        ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            ref = hf(ids).logits
            got = model(ids, torch.arange(7).expand(2, 7), None)[..., : cfg.vocab_size]
        logits[case] = dict(
            missing=[k for k in loaded.missing_keys if not k.endswith("_extra_state")],
            unexpected=list(loaded.unexpected_keys),
            diff=(got - ref).abs().max().item(),
            scale=ref.abs().max().item(),
        )
    print(json.dumps(dict(shapes=shapes, logits=logits)))
    """
)


def _mcore_config(cfg, num_layers, moe_freq):
    heads = cfg.num_attention_heads
    bias = bool(getattr(cfg, "attention_bias", False))
    out = dict(
        num_layers=num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=heads,
        num_query_groups=cfg.num_key_value_heads,
        kv_channels=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        ffn_hidden_size=cfg.intermediate_size,
        add_bias_linear=bias,
        add_qkv_bias=cfg.model_type in ("qwen2", "qwen2_moe") or bias,
        qk_layernorm=cfg.model_type.startswith("qwen3"),
    )
    if family(cfg.model_type).latent_attention:
        # megatron's local spec builds MLA's latent norms when qk_layernorm is set
        out.update(
            multi_latent_attention=True,
            qk_layernorm=True,
            num_query_groups=heads,
            q_lora_rank=cfg.q_lora_rank,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_head_dim=cfg.qk_nope_head_dim,
            qk_pos_emb_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim,
            rope_type="rope",
        )
    if any(moe_freq):
        experts, ffn = _experts(cfg)
        out.update(
            num_moe_experts=experts,
            moe_ffn_hidden_size=ffn,
            moe_router_topk=cfg.num_experts_per_tok,
            moe_layer_freq=[int(m) for m in moe_freq],
        )
    if any(moe_freq) and cfg.model_type in _GLM_MOE:
        out.update(
            moe_shared_expert_intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
        )
    if any(moe_freq) and cfg.model_type == "qwen2_moe":
        out.update(
            moe_shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
            moe_shared_expert_gate=True,
        )
    return out


# (case, pp_size, pp_rank): whole models, and both stages of a tied model split in two.
# megatron-core's local layer spec builds no Gated DeltaNet (its gated_delta_net spec needs
# TransformerEngine's fused norm-linear), nor MLA without q_lora_rank and with the latent norm
# (it wants a fused norm-linear as q_proj): those names are model_test's, their shapes the
# formula's above.
_STAGES = [
    *((c, 1, 0) for c in CASES if c not in ("qwen3_5_text", "deepseek_v3-q_proj")),
    ("qwen2-tied", 2, 0),
    ("qwen2-tied", 2, 1),
]


@pytest.fixture(scope="module")
def megatron_built(checkpoints):
    spec = []
    for case, pp, rank in _STAGES:
        cfg, _ = checkpoints[case]
        per = cfg.num_hidden_layers // pp
        spec.append(
            dict(
                id=f"{case}/{pp}/{rank}",
                config=_mcore_config(cfg, per, moe_layers(cfg)[rank * per : (rank + 1) * per]),
                vocab_size=padded_vocab_size(cfg.vocab_size, 1),
                pre=rank == 0,
                post=rank == pp - 1,
                tied=cfg.tie_word_embeddings,
            )
        )
    proc = subprocess.run(
        [sys.executable, "-c", _MEGATRON_SCRIPT],
        input=json.dumps(dict(spec=spec, twinkle=CASES)),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_names_and_shapes_match_megatron_cores_gpt_model(checkpoints, megatron_built):
    """The state_dict of megatron-core's GPTModel (local layer spec) is exactly our output."""
    for case, pp, rank in _STAGES:
        cfg, state = checkpoints[case]
        local = hf_to_mcore(state, cfg, pp_rank=rank, pp_size=pp)
        shapes = {name: list(t.shape) for name, t in local.items()}
        assert megatron_built["shapes"][f"{case}/{pp}/{rank}"] == shapes, (case, pp, rank)


def test_bridged_checkpoint_gives_hf_logits_in_twinkles_gpt_model(megatron_built):
    """save_pretrained -> SafetensorsReader -> hf_to_mcore -> build_gpt_model: every parameter
    is loaded and the logits are HF's. fp32 on both sides; dense models agree exactly in
    practice, MoE adds expert outputs in another order, hence 1e-5. A wrong qkv interleaving
    moves the logits by ~0.4 (they are ~0.4 in size)."""
    results = megatron_built["logits"]
    assert results.keys() == CASES.keys()
    for case, r in results.items():
        assert r["missing"] == [] and r["unexpected"] == [], case
        assert r["diff"] <= 1e-5 and r["scale"] > 0.1, (case, r)


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
