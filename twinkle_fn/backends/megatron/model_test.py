import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from transformers import AutoModelForCausalLM
from transformers.core_model_loading import revert_weight_conversion

from twinkle_fn.backends.megatron import parallel
from twinkle_fn.backends.megatron.bridge import hf_to_mcore
from twinkle_fn.backends.megatron.model import build_gpt_model
from twinkle_fn.mesh import Mesh
from twinkle_fn.models import families
from twinkle_fn.models.families import FAMILIES, family
from twinkle_fn.testing import tiny_config
from twinkle_fn.testing_dist import spawn

# The families megatron-core builds (the others are refused: config_test).
BUILT = tuple(name for name in FAMILIES if family(name).megatron is None)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # scales 3 of the 4 frequencies of head_dim 8
}
CASES = {
    **{family: (family, {}) for family in BUILT},
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "llama-rope3": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "mistral-window": ("mistral", {"sliding_window": 4}),
    "qwen3_moe-dense0-normed": ("qwen3_moe", {"mlp_only_layers": [0], "norm_topk_prob": True}),
    "deepseek_v3-q_proj": ("deepseek_v3", {"q_lora_rank": None}),
}
SEQ = 12
# fp32 logits of the same weights through different kernels (megatron's linears and MoE
# dispatch vs transformers'): observed <= 1e-7; 1e-5 leaves room for other BLAS builds.
ATOL = 1e-5


def _expected_names(case: str) -> set[str]:
    """The mcore names the bridge writes (local spec), derived from the HF config alone."""
    family, extra = CASES[case]
    cfg = tiny_config(family, **extra)
    names = {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight"}
    if not cfg.tie_word_embeddings:
        names.add("output_layer.weight")
    dense_layers = set(getattr(cfg, "mlp_only_layers", None) or ())
    dense_layers |= set(range(getattr(cfg, "first_k_dense_replace", 0)))  # GLM-4 MoE
    types = getattr(cfg, "layer_types", None) or ()
    for i in range(cfg.num_hidden_layers):
        p = f"decoder.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "pre_mlp_layernorm.weight"}
        if types and types[i] == "linear_attention":  # Qwen3.5's Gated DeltaNet
            gdn = ("in_proj.weight", "conv1d.weight", "A_log", "dt_bias", "out_norm.weight")
            names |= {p + "self_attention." + n for n in (*gdn, "out_proj.weight")}
            names |= {p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"}
            continue
        if families.family(family).latent_attention:
            attention = ["q_down_proj", "q_up_proj"] if cfg.q_lora_rank else ["q_proj"]
            attention += ["kv_down_proj", "kv_up_proj", "proj"]
            names |= {p + f"self_attention.linear_{n}.weight" for n in attention}
            names.add(p + "self_attention.kv_layernorm.weight")
            if cfg.q_lora_rank:
                names.add(p + "self_attention.q_layernorm.weight")
        else:
            names |= {p + f"self_attention.linear_{n}.weight" for n in ("qkv", "proj")}
        if family in ("qwen2", "qwen2_moe") or getattr(cfg, "attention_bias", False):
            names.add(p + "self_attention.linear_qkv.bias")
        if getattr(cfg, "mlp_bias", False):
            names |= {p + "self_attention.linear_proj.bias", p + "mlp.linear_fc1.bias"}
            names.add(p + "mlp.linear_fc2.bias")
        if family.startswith("qwen3"):
            names |= {
                p + "self_attention.q_layernorm.weight",
                p + "self_attention.k_layernorm.weight",
            }
        moe_families = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3")
        if family in moe_families and i not in dense_layers:
            names.add(p + "mlp.router.weight")
            for j in range(getattr(cfg, "num_experts", None) or cfg.num_local_experts):
                e = f"{p}mlp.experts.local_experts.{j}."
                names |= {e + "linear_fc1.weight", e + "linear_fc2.weight"}
            if family in ("qwen2_moe", "glm4_moe", "deepseek_v3"):
                shared = p + "mlp.shared_experts."
                names |= {shared + n for n in ("linear_fc1.weight", "linear_fc2.weight")}
            if family == "qwen2_moe":
                names.add(shared + "gate_weight")
        else:
            names |= {p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"}
    return names


def _hf_model(case: str):
    family, extra = CASES[case]
    cfg = tiny_config(family, **extra)
    torch.manual_seed(1)
    return cfg, AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _tokens(cfg, batch=2):
    ids = torch.randint(0, cfg.vocab_size, (batch, SEQ), generator=torch.Generator().manual_seed(3))
    return ids, torch.arange(SEQ).expand(batch, SEQ)


def _load(model, hf, cfg, mesh: Mesh, rank: int, vocab_multiple: int = 128) -> None:
    coords, expert = mesh.coords(rank), mesh.expert_coords(rank)
    local = hf_to_mcore(
        revert_weight_conversion(hf, hf.state_dict()),
        cfg,
        tp_rank=coords["tp"],
        tp_size=mesh.tp,
        pp_rank=coords["pp"],
        pp_size=mesh.pp,
        ep_rank=expert["ep"],
        ep_size=mesh.ep,
        etp_size=mesh.etp,
        vocab_multiple=vocab_multiple,
    )
    missing, unexpected = model.load_state_dict(local, strict=False)
    assert unexpected == [] and all(k.endswith("._extra_state") for k in missing), (
        missing,
        unexpected,
    )


def test_build_needs_initialized_megatron(monkeypatch):
    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match=r"parallel.initialize\(mesh\)"):
        build_gpt_model(tiny_config("qwen2"), Mesh())


@pytest.mark.parametrize("case", sorted(CASES))
def test_parameter_names_are_the_bridge_convention(megatron_world, case):
    family, extra = CASES[case]
    model = build_gpt_model(tiny_config(family, **extra), Mesh())
    names = _expected_names(case)
    assert {n for n, _ in model.named_parameters()} == names
    # GLM-4 MoE's router bias is a buffer of the checkpoint, not a parameter
    row = families.family(family)
    moe = set(row.moe_layers(tiny_config(family, **extra)))
    bias = row.moe and row.moe.expert_bias
    buffers = {f"decoder.layers.{i}.mlp.router.expert_bias" for i in moe} if bias else set()
    assert {k for k in model.state_dict() if not k.endswith("._extra_state")} == names | buffers


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers_on_the_same_weights(megatron_world, case):
    cfg, hf = _hf_model(case)
    model = build_gpt_model(cfg, Mesh()).eval()
    _load(model, hf, cfg, Mesh(), 0)
    ids, pos = _tokens(cfg)
    with torch.no_grad():
        logits = model(ids, pos, None)
        want = hf(ids).logits
    assert logits.shape == (2, SEQ, 128)  # vocab 96 padded to 128
    torch.testing.assert_close(logits[..., : cfg.vocab_size], want, rtol=0, atol=ATOL)


@pytest.mark.parametrize("case", ["qwen3", "qwen3_moe", "qwen3_5_text", "deepseek_v3"])
def test_packed_logits_match_each_sample_alone(megatron_world, case):
    """THD packing (rope restarts per sample, SDPA per sample; a Gated DeltaNet's convolution
    and recurrence restart at cu_seqlens) == unpacked HF logits."""
    cfg, hf = _hf_model(case)
    model = build_gpt_model(cfg, Mesh()).eval()
    _load(model, hf, cfg, Mesh(), 0)
    lens = [5, 3, 7, 1]
    gen = torch.Generator().manual_seed(4)
    samples = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lens]
    cu = torch.tensor([0, 5, 8, 15, 16], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7
    )
    ids = torch.cat(samples)[None]
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    with torch.no_grad():
        logits = model(ids, pos, None, packed_seq_params=params)[0, :, : cfg.vocab_size]
        want = torch.cat([hf(s[None]).logits[0] for s in samples])
    torch.testing.assert_close(logits, want, rtol=0, atol=ATOL)


def test_mesh_must_match_megatron_and_rope_must_be_static(megatron_world):
    with pytest.raises(ValueError, match="mesh tp=2 but megatron-core was initialized with tp=1"):
        build_gpt_model(tiny_config("qwen2"), Mesh(tp=2))
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ValueError, match="rope_type='yarn' is not supported"):
        build_gpt_model(tiny_config("llama", rope_parameters=yarn), Mesh())


# (case, mesh sizes): tensor parallel (+ sequence parallel), pipeline parallel with tied
# embeddings (the last stage's output copy), expert parallel, and an MoE under tp + sp.
MULTI_RANK = [
    ("qwen3", dict(tp=2)),
    ("qwen2", dict(tp=2, sequence_parallel=True)),
    ("qwen2-tied", dict(pp=2)),
    ("llama-rope3", dict(pp=2)),
    ("qwen3_moe", dict(dp=2, ep=2)),
    ("qwen3_moe-dense0-normed", dict(tp=2, sequence_parallel=True)),
]
VOCAB_MULTIPLE = 16  # 96 rows split 48 + 48 over tp=2 (128 would leave rank 1 all padding)


def _forward_only(model, ids, pos):
    """Logits through megatron's schedule (1F1B p2p when pp > 1); None off the last stage."""

    def step(_, module):
        out = module(ids, pos, None)
        return out, lambda logits: (logits.sum(), torch.tensor(1), {"logits": logits})

    results = get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=None,
        model=[model],
        num_microbatches=1,
        seq_length=SEQ,
        micro_batch_size=ids.shape[0],
        forward_only=True,
    )
    return results[0]["logits"] if results else None


def _multi_rank_logit_errors() -> list[float | None]:
    """Per case, this rank's max |mcore - HF| over its vocab slice (None off the last stage)."""
    rank, errors = dist.get_rank(), []
    for case, sizes in MULTI_RANK:
        mesh = Mesh(**sizes)
        parallel.initialize(mesh, seed=0)
        cfg, hf = _hf_model(case)
        model = build_gpt_model(cfg, mesh, vocab_multiple=VOCAB_MULTIPLE).eval()
        _load(model, hf, cfg, mesh, rank, VOCAB_MULTIPLE)
        ids, pos = _tokens(cfg)
        with torch.no_grad():
            logits = _forward_only(model, ids, pos)
            want = hf(ids).logits
        if logits is None:
            errors.append(None)
        else:
            rows = logits.shape[-1]  # this tp rank's slice of the (unpadded, here) vocab
            start = mesh.coords(rank)["tp"] * rows
            errors.append((logits - want[..., start : start + rows]).abs().max().item())
        parallel.destroy()
    return errors


# megatron norm -> HF norm whose gradient it must reproduce under tp=2 + sequence parallel.
NORMS = {
    "decoder.layers.0.input_layernorm.weight": "model.layers.0.input_layernorm.weight",
    "decoder.layers.1.pre_mlp_layernorm.weight": "model.layers.1.post_attention_layernorm.weight",
    "decoder.layers.1.self_attention.q_layernorm.weight": "model.layers.1.self_attn.q_norm.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
}


def ddp_backward(
    model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor, labels: torch.Tensor
) -> DistributedDataParallel:
    """`model` in megatron's DDP after one forward-backward (megatron's schedule, one
    micro-batch) of the summed cross entropy of `labels`; gradients in each ``main_grad``.
    `ids`, `pos`, `labels`: ``[batch, seq]``."""
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)

    def step(_, module):
        losses = module(ids, pos, None, labels=labels)
        return losses, lambda out: (out.sum(), torch.tensor(out.numel()), {})

    ddp.zero_grad_buffer()
    get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=None,
        model=[ddp],
        num_microbatches=1,
        seq_length=ids.shape[1],
        micro_batch_size=ids.shape[0],
    )
    return ddp


def _sp_norm_grad_errors() -> dict[str, float]:
    """Per norm, max |megatron grad - HF grad| after DDP's finalize (tp=2, SP, token-mean CE)."""
    mesh = Mesh(tp=2, sequence_parallel=True)
    parallel.initialize(mesh, seed=0)
    cfg, hf = _hf_model("qwen3")
    model = build_gpt_model(
        cfg, mesh, vocab_multiple=VOCAB_MULTIPLE, finalize_model_grads_func=finalize_model_grads
    )
    _load(model, hf, cfg, mesh, dist.get_rank(), VOCAB_MULTIPLE)
    ids, pos = _tokens(cfg)
    labels = ids.roll(-1, dims=1)
    ddp = ddp_backward(model, ids, pos, labels)
    F.cross_entropy(hf(ids).logits.flatten(0, 1), labels.flatten()).backward()
    hf_params = dict(hf.named_parameters())
    mcore_params = dict(ddp.module.named_parameters())
    errors = {
        name: (mcore_params[name].main_grad - hf_params[hf_name].grad).abs().max().item()
        for name, hf_name in NORMS.items()
    }
    parallel.destroy()
    return errors


def _two_rank_checks() -> tuple[list[float | None], dict[str, float]]:
    return _multi_rank_logit_errors(), _sp_norm_grad_errors()


def test_two_ranks_tp_pp_ep_logits_and_sequence_parallel_norm_grads():
    """Logits equal transformers' on every mesh; under SP the norms' grads are all-reduced.

    Without the norms' ``sequence_parallel`` flag each tp rank would keep the grad of its own
    half of the sequence. fp32 grads of a token-mean CE: 1e-6 (absolute).
    """
    per_rank = spawn(_two_rank_checks, 2)
    for i, (case, sizes) in enumerate(MULTI_RANK):
        mesh = Mesh(**sizes)
        for rank in range(2):
            error = per_rank[rank][0][i]
            if mesh.is_pp_last(rank):
                assert error is not None and error <= ATOL, (case, sizes, rank, error)
            else:
                assert error is None, (case, sizes, rank)
    for rank in range(2):
        for name, error in per_rank[rank][1].items():
            assert error <= 1e-6, (rank, name, error)
