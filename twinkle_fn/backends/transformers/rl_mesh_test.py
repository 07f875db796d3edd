"""GRPO and DPO on every mesh of the transformers backend against one process: the RL rows of
the parity table.

GRPO is `tf.losses.ppo_loss` with every option on (asymmetric clip, k3 KL to per-token
``ref_logps``, per-token advantages and ``old_logps``, entropy bonus, TIS cap, sequence-mean
weights); DPO reads per-token ``ref_logps`` on 4 interleaved pairs per step. One two-rank spawn
runs dp2, fsdp2, tp2 and tp2+sp, each on packed and on padded batches; one four-rank spawn runs
HSDP (dp2 x fsdp2: one pair per data rank). The one-process reference trains packed batches, so
padded runs also check that padding changes nothing. The two-rank spawn also runs the whole GRPO
loop (`twinkle_fn.grpo.iterations`) on dp2: every rank samples the same batch and trains its half.

Tolerances (float64 throughout, those of `fsdp_test`): the ranks sum the same token terms in
another order, so losses agree to 1e-11 relative; parameters after 2 AdamW steps to 1e-9
relative and 1e-11 absolute (Adam divides tiny gradients by their own scale, which keeps
relative errors of that order).
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

import twinkle_fn as tf
from twinkle_fn import grpo
from twinkle_fn.data import char_tokenizer, pack, pad_collate
from twinkle_fn.distributed import rank
from twinkle_fn.testing import random_features, tiny_config, with_rl_fields
from twinkle_fn.testing_dist import spawn

STEPS = 2
LOSSES = {
    "grpo": tf.losses.ppo_loss(
        0.2, 0.28, beta=0.1, entropy_coef=0.01, tis_cap=1.5, aggregation="seq_mean_token_mean"
    ),
    "dpo": tf.losses.dpo_loss(0.5, label_smoothing=0.1),
}
TWO_RANKS = {
    "dp2": {"dp": 2},
    "fsdp2": {"fsdp": 2},
    "tp2": {"tp": 2},
    "tp2+sp": {"tp": 2, "sequence_parallel": True},
}
FOUR_RANKS = {"hsdp:dp2xfsdp2": {"dp": 2, "fsdp": 2}}
LAYOUTS = ("packed", "padded")
LOSS_RTOL, PARAM_RTOL, PARAM_ATOL = 1e-11, 1e-9, 1e-11


def _train(mesh_sizes, loss, layout):
    """STEPS steps of 8 sequences (each data rank its slice; for DPO whole pairs): the losses
    and pair / token counts of every step, and the final params (whole, by HF name)."""
    mesh = tf.Mesh(**mesh_sizes)
    model = tf.models.from_hf_config(tiny_config("qwen2"), seed=0, device="cpu")
    model.module.to(torch.float64)
    state = tf.init(model, tf.optim.adamw(1e-2), mesh)
    infos = []
    for i in range(STEPS):
        feats = with_rl_fields(random_features(8, seed=300 + i), seed=i)
        mine = feats[mesh.get_slice(len(feats), rank())] if mesh.world_size > 1 else feats
        batch = pack(mine) if layout == "packed" else pad_collate(mine, pad_token_id=0)
        grads, _ = tf.fwd_bwd(state, batch, loss=LOSSES[loss])
        state, info = tf.step(state, grads)
        infos.append((float(info["loss"]), int(info["num_tokens"])))
    return infos, tf.unshard(state)


def _loop(mesh_sizes):
    """Two GRPO loop iterations (KL on) on `mesh_sizes`, float64 throughout (trainer, stream,
    sampler): each step's reward and loss, and the final params."""
    mesh = tf.Mesh(**mesh_sizes)
    tokenizer = char_tokenizer()
    config = tiny_config("qwen2", vocab_size=len(tokenizer))
    model = tf.models.from_hf_config(config, seed=0, device="cpu")
    model.module.to(torch.float64)
    state = tf.init(model, tf.optim.adamw(1e-2), mesh)
    sampler = AutoModelForCausalLM.from_config(config).to(torch.float64).eval()
    grpo.sync(sampler, state, torch.float64)
    rl = grpo.GRPOConfig(prompts_per_step=2, group_size=4, max_new_tokens=3, beta=0.04)
    prompts = grpo.task_prompts(tokenizer, 4, seed=0)
    reference = grpo.reference_of(sampler)
    steps = list(
        grpo.iterations(
            state, sampler, tokenizer, prompts, rl, 2, reference=reference, sync_dtype=torch.float64
        )
    )
    return [(r["reward"], r["loss"]) for _, r in steps], tf.unshard(steps[-1][0])


def _every_case(meshes, loop=False):
    out = {
        (loss, name, layout): _train(sizes, loss, layout)
        for name, sizes in meshes.items()
        for loss in LOSSES
        for layout in LAYOUTS
    }
    if loop:
        out["loop", "dp2"] = _loop({"dp": 2})
    return out


@pytest.fixture(scope="module")
def reference():
    return {loss: _train({}, loss, "packed") for loss in LOSSES}


@pytest.fixture(scope="module")
def two_ranks():
    return spawn(_every_case, 2, TWO_RANKS, True, timeout_s=300)


@pytest.fixture(scope="module")
def four_ranks():
    return spawn(_every_case, 4, FOUR_RANKS, timeout_s=300)


def _assert_same(got, want):
    (infos, params), (ref_infos, ref_params) = got, want
    for (loss, n), (ref, ref_n) in zip(infos, ref_infos, strict=True):
        assert loss == pytest.approx(ref, rel=LOSS_RTOL) and n == ref_n
    assert params.keys() == ref_params.keys()
    for name, p in params.items():
        torch.testing.assert_close(p, ref_params[name], rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=name)


def test_the_reference_counts_tokens_for_grpo_and_pairs_for_dpo(reference):
    assert [n for _, n in reference["dpo"][0]] == [4, 4]
    assert all(n > 8 for _, n in reference["grpo"][0])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mesh", list(TWO_RANKS))
@pytest.mark.parametrize("loss", list(LOSSES))
def test_a_two_rank_mesh_matches_one_process(reference, two_ranks, loss, mesh, layout):
    for per_rank in two_ranks:
        _assert_same(per_rank[loss, mesh, layout], reference[loss])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("loss", list(LOSSES))
def test_hsdp_on_four_ranks_matches_one_process(reference, four_ranks, loss, layout):
    for per_rank in four_ranks:
        _assert_same(per_rank[loss, "hsdp:dp2xfsdp2", layout], reference[loss])


def test_the_grpo_loop_on_dp2_samples_the_same_batch_and_trains_as_one_process(two_ranks):
    """Every rank draws the whole batch from the same seed and trains its half: the rewards
    (the same samples) equal one process's; losses and params after 4 AdamW updates agree to
    the tolerances above."""
    want_records, want_params = _loop({})
    for per_rank in two_ranks:
        records, params = per_rank["loop", "dp2"]
        assert [r for r, _ in records] == [r for r, _ in want_records]
        assert [loss for _, loss in records] == pytest.approx(
            [loss for _, loss in want_records], rel=LOSS_RTOL
        )
        for name, p in params.items():
            torch.testing.assert_close(p, want_params[name], rtol=PARAM_RTOL, atol=PARAM_ATOL)
