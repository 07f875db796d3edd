"""The bridge against megatron-core itself: one gloo process (tp=1, CPU) builds (a)
megatron-core's GPTModels with its own local layer spec from TransformerConfigs written here,
whose state_dict names and shapes must be exactly `hf_to_mcore`'s output, and (b) twinkle's
build_gpt_model, which loads a bridged save_pretrained checkpoint and gives HF's logits. The
cases are ``bridge_test``'s."""

import json
import subprocess
import sys
import textwrap

import pytest

from twinkle_fn.backends.megatron.bridge import hf_to_mcore, moe_layers
from twinkle_fn.backends.megatron.bridge_test import _GLM_MOE, CASES, _experts
from twinkle_fn.backends.megatron.bridge_transforms import padded_vocab_size
from twinkle_fn.models.families import family

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
