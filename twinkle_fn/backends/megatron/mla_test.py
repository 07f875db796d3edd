"""Multi-latent attention on the megatron backend (`twinkle_fn.backends.megatron.mla`).

One process (`megatron_world`): logits equal HF's under YaRN rotary, and the configs megatron's
MLA would compute differently are refused naming the field. Two spawned gloo ranks, once for
the file: every parameter's gradient under tp2 equals HF's, with sequence parallelism (the MoE
tiny config) and without it (all layers dense), with a query down projection and without;
and a LoRA adapter trained there (q_proj, tp2 + sequence parallelism) loads in peft with the
megatron model's log-probs.

Tolerances (float32). Logits of the same weights: 1e-5 absolute (observed <= 5e-7 under YaRN,
whose cos/sin megatron computes with another matmul). Gradients of a token-mean loss: 1e-6
absolute (the tp ranks sum the same terms in another order); megatron's own MLA path, which
trains the rotary key on one rank's heads only, is off by up to 2e-4 in every case (the
embedding's gradient, upstream of the key). Log-probs through peft: 1e-5, as in the conformance suite.
"""

import pytest
import torch
import torch.distributed as dist
from megatron.core.distributed import (
    finalize_model_grads,
)
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM
from transformers.core_model_loading import revert_weight_conversion

import twinkle_fn as tf
from twinkle_fn.backends.megatron import parallel
from twinkle_fn.backends.megatron.bridge import hf_to_mcore, mcore_to_hf
from twinkle_fn.backends.megatron.config import transformer_config
from twinkle_fn.backends.megatron.model import build_gpt_model
from twinkle_fn.backends.megatron.model_test import ddp_backward
from twinkle_fn.data import pad_collate
from twinkle_fn.export_test import hf_logps
from twinkle_fn.mesh import Mesh
from twinkle_fn.testing import random_features, tiny_config
from twinkle_fn.testing_dist import spawn

SEQ, VOCAB_MULTIPLE = 12, 16
LOGITS_ATOL, GRAD_ATOL, LOGPS_ATOL = 1e-5, 1e-6, 1e-5
# DeepSeek-V3's YaRN ratios (mscale == mscale_all_dim), over a short original context so that
# the ramp between interpolated and extrapolated frequencies falls inside the rotary dims.
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "original_max_position_embeddings": 8,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
# (config overrides, mesh sizes): the MoE tiny config under tp + sp (megatron trains MoE under
# tp only with it), all layers dense without sp, each with and without q_lora_rank.
GRAD_CASES = [
    ({}, {"tp": 2, "sequence_parallel": True}),
    ({"q_lora_rank": None}, {"tp": 2, "sequence_parallel": True}),
    ({"first_k_dense_replace": 2}, {"tp": 2}),
    ({"first_k_dense_replace": 2, "q_lora_rank": None}, {"tp": 2}),
]
LORA_CONFIG = {"q_lora_rank": None}
LORA = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)


def _hf(overrides: dict) -> torch.nn.Module:
    """The seed-0 HF model of the tiny config with `overrides` (``from_hf_config(seed=0)``)."""
    torch.manual_seed(0)
    config = tiny_config("deepseek_v3", **overrides)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _tokens(batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 96, (batch, SEQ), generator=torch.Generator().manual_seed(3))
    return ids, torch.arange(SEQ).expand(batch, SEQ)


def _local(hf: torch.nn.Module, mesh: Mesh, rank: int) -> dict[str, torch.Tensor]:
    """This rank's megatron tensors of `hf`'s weights."""
    coords = mesh.coords(rank)
    return hf_to_mcore(
        revert_weight_conversion(hf, hf.state_dict()),
        hf.config,
        tp_rank=coords["tp"],
        tp_size=mesh.tp,
        vocab_multiple=VOCAB_MULTIPLE,
    )


def _grad_errors(overrides: dict, sizes: dict) -> dict[str, float]:
    """Per HF parameter, max |megatron grad - HF grad| of a token-mean loss on `sizes`."""
    mesh = Mesh(**sizes)
    parallel.initialize(mesh, seed=0)
    hf = _hf(overrides)
    model = build_gpt_model(
        hf.config,
        mesh,
        vocab_multiple=VOCAB_MULTIPLE,
        finalize_model_grads_func=finalize_model_grads,
    )
    model.load_state_dict(_local(hf, mesh, dist.get_rank()), strict=False)
    ids, pos = _tokens()
    labels = ids.roll(-1, dims=1)
    ddp = ddp_backward(model, ids, pos, labels)
    torch.nn.functional.cross_entropy(hf(ids).logits.flatten(0, 1), labels.flatten()).backward()
    # the bridge joins gradients as it joins the weights they belong to
    grads = {n: p.main_grad for n, p in ddp.module.named_parameters()}
    grads |= {n: torch.zeros_like(b) for n, b in ddp.module.named_buffers() if "expert_bias" in n}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (mesh.coords(dist.get_rank())["tp"], grads))
    states = {(tp, 0, 0): part for tp, part in gathered}
    whole = dict(
        mcore_to_hf(states, hf.config, tp_size=mesh.tp, pp_size=1, vocab_multiple=VOCAB_MULTIPLE)
    )
    want = revert_weight_conversion(hf, {n: p.grad for n, p in hf.named_parameters()})
    parallel.destroy()
    return {n: (whole[n] - g).abs().max().item() for n, g in want.items()}


def _lora_logps(path: str) -> torch.Tensor:
    """The log-probs of a LoRA model (random B) on tp2 + sp, its adapter saved to `path`."""
    config = tiny_config("deepseek_v3", **LORA_CONFIG)
    model = tf.lora.add_lora(tf.models.from_hf_config(config, seed=0, backend="megatron"), LORA)
    state = tf.init(model, tf.optim.megatron_optimizer(1e-2), Mesh(tp=2, sequence_parallel=True))
    batch = pad_collate(random_features(4, seed=99), pad_token_id=0)
    logps = tf.token_logps(state, batch)["logps"]
    tf.lora.save_adapter(state, path)
    parallel.destroy()
    return logps


def _two_ranks(path: str) -> dict:
    grads = {i: _grad_errors(*case) for i, case in enumerate(GRAD_CASES)}
    return {"grads": grads, "lora": _lora_logps(path)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    path = tmp_path_factory.mktemp("mla") / "adapter"
    return path, spawn(_two_ranks, 2, str(path), timeout_s=600)


@pytest.mark.parametrize("case", range(len(GRAD_CASES)), ids=lambda i: str(GRAD_CASES[i]))
def test_every_gradient_under_tp2_is_hfs(two_ranks, case):
    for per_rank in two_ranks[1]:
        errors = per_rank["grads"][case]
        assert any("kv_a_proj_with_mqa" in n for n in errors)
        bad = {n: e for n, e in errors.items() if e > GRAD_ATOL}
        assert not bad, bad


def test_a_tp2_lora_adapter_loads_in_peft(two_ranks):
    path, runs = two_ranks
    model = PeftModel.from_pretrained(_hf(LORA_CONFIG), path).eval()
    batch = pad_collate(random_features(4, seed=99), pad_token_id=0)
    got = hf_logps(model, batch)
    for per_rank in runs:
        torch.testing.assert_close(got, per_rank["lora"], rtol=0, atol=LOGPS_ATOL)
    with model.disable_adapter():
        assert (hf_logps(model, batch) - got).abs().max() > 1e-3


def test_yarn_logits_equal_hfs(megatron_world):
    hf = _hf({"rope_parameters": YARN, "qk_rope_head_dim": 8})
    model = build_gpt_model(hf.config, Mesh(), vocab_multiple=VOCAB_MULTIPLE).eval()
    model.load_state_dict(_local(hf, Mesh(), 0), strict=False)
    ids, pos = _tokens()
    with torch.no_grad():
        got = model(ids, pos, None)[..., : hf.config.vocab_size]
        want = hf(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=LOGITS_ATOL)
    # YaRN changed the logits 100x more than the tolerance (observed 1.2e-3: the tiny random
    # model's logits are ~0.2), so the comparison above saw YaRN's rotary and softmax scale
    plain = _hf({"qk_rope_head_dim": 8})
    plain.load_state_dict(hf.state_dict())
    with torch.no_grad():
        assert (plain(ids).logits - want).abs().max() > 100 * LOGITS_ATOL


@pytest.mark.parametrize(
    ("overrides", "tp", "message"),
    [
        ({"rope_interleave": False}, 1, "rope_interleave=False is not supported"),
        (
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
            1,
            "rope_type='linear' is not supported with multi-latent attention",
        ),
        (
            {"rope_parameters": {**YARN, "attention_factor": 1.5}},
            1,
            "attention_factor=1.5 is not supported",
        ),
        ({"rope_parameters": {**YARN, "truncate": False}}, 1, "truncate=False is not supported"),
        (
            {"rope_parameters": {**YARN, "mscale": None}},
            1,
            "mscale_all_dim=1.0 without mscale is not supported",
        ),
        ({"q_lora_rank": 15}, 2, r"tp=2 does not divide q_lora_rank=15"),
        (
            {"kv_lora_rank": 15},
            2,
            r"tp=2 does not divide kv_lora_rank \+ qk_rope_head_dim=19",
        ),
    ],
)
def test_what_megatrons_mla_computes_otherwise_is_refused(overrides, tp, message):
    with pytest.raises(ValueError, match=message):
        transformer_config(tiny_config("deepseek_v3", **overrides), Mesh(tp=tp))
