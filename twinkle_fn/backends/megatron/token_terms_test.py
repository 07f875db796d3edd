"""A loss other than the default cross entropy on the megatron backend: the vocab-parallel
log-probabilities and entropy against float64 references (and two tensor-parallel ranks against
one), a whole model's policy gradient against the HF model's in float64, and micro-batches /
accumulated calls against one batch. Meshes (tp, cp, pp) are compared with one process in
``backend_test``.

Tolerances (megatron computes in float32 here). The terms: float32 rounding of a log-sum-exp
over 10 logits of size ~3, 1e-5. The model: the loss sum (~20, a sum of ~100 terms) to 1e-5
relative; gradients to 1e-4 relative and 1e-6 absolute (float32 sums of a few hundred products,
as ``fused_loss_test`` compares its gradients). Micro-batches and accumulated calls sum the same
float32 terms in another order: 1e-5 relative on the loss, 1e-6 absolute on gradients.
"""

import pytest
import torch

import twinkle_fn as tf
from twinkle_fn.backends.megatron import parallel
from twinkle_fn.backends.megatron import token_terms as token_terms_module
from twinkle_fn.backends.megatron.bridge import mcore_to_hf
from twinkle_fn.backends.megatron.placement import model_placement
from twinkle_fn.backends.megatron.token_terms import TokenTerms, token_terms, vocab_parallel_terms
from twinkle_fn.data import pack, pad_collate
from twinkle_fn.distributed import rank
from twinkle_fn.mesh import Mesh
from twinkle_fn.testing import (
    policy_gradient_reference,
    ppo_reference,
    preference_reference,
    random_features,
    tiny_config,
    weighted_ce_reference,
    with_advantages,
    with_loss_scale,
    with_rl_fields,
)
from twinkle_fn.testing_dist import spawn

VOCAB, PADDED = 10, 16
PG = tf.losses.policy_gradient(entropy_coef=0.1)
# every option on: asymmetric clip, k3 KL, entropy bonus, TIS cap, sequence-mean weights
PPO = tf.losses.ppo_loss(
    0.2, 0.28, beta=0.1, entropy_coef=0.01, tis_cap=1.5, aggregation="seq_mean_token_mean"
)


def _logits(vocab=VOCAB, seed=0):
    """float32 ``[s, b, padded vocab]`` logits whose padding columns are huge (unmasked, they
    would take all the softmax mass), and ``[s, b]`` labels with ignored tokens."""
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(5, 3, PADDED, generator=gen, dtype=torch.float64)
    logits[..., vocab:] = 50.0
    labels = torch.randint(0, vocab, (5, 3), generator=gen)
    labels[1, 0] = labels[4, 2] = -100
    return logits.float().requires_grad_(), labels


def test_logps_and_entropy_equal_a_float64_log_softmax_over_the_real_vocabulary(megatron_world):
    logits, labels = _logits()
    logps, entropy = vocab_parallel_terms(logits, labels, VOCAB, entropy=True)
    grad = torch.autograd.grad(logps.sum() + 0.3 * entropy.sum(), logits)[0]
    ref_logits = logits.detach().double().requires_grad_()
    logp = torch.log_softmax(ref_logits[..., :VOCAB], dim=-1)
    keep = labels != -100
    want_logps = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * keep
    want_entropy = -(logp.exp() * logp).sum(-1) * keep
    (want_grad,) = torch.autograd.grad(want_logps.sum() + 0.3 * want_entropy.sum(), ref_logits)
    assert logps.dtype == entropy.dtype == torch.float32 and logps.shape == labels.shape
    for got, want in ((logps, want_logps), (entropy, want_entropy), (grad, want_grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert (logps[~keep] == 0).all() and (entropy[~keep] == 0).all()
    assert (grad[..., VOCAB:] == 0).all()  # padding columns: no mass, no gradient
    assert vocab_parallel_terms(logits, labels, VOCAB, entropy=False)[1] is None


def _terms_and_grad(logits, labels, vocab):
    logps, entropy = vocab_parallel_terms(logits, labels, vocab, entropy=True)
    (grad,) = torch.autograd.grad(logps.sum() + 0.3 * entropy.sum(), logits)
    return logps.detach(), entropy.detach(), grad


def _on_two_tp_ranks(vocabs):
    """Each tensor-parallel rank's terms and logits gradient from its half of the columns."""
    parallel.initialize(Mesh(tp=2), seed=0)
    try:
        out = []
        for vocab in vocabs:
            logits, labels = _logits(vocab)
            half = logits.detach()[..., rank() * PADDED // 2 : (rank() + 1) * PADDED // 2]
            out.append(_terms_and_grad(half.clone().requires_grad_(), labels, vocab))
        return out
    finally:
        parallel.destroy()


def test_two_tensor_parallel_ranks_give_the_one_rank_terms_and_gradient(megatron_world):
    """Vocabulary 10 of 16 columns: rank 1 holds ids 8-9 and padding; vocabulary 6: rank 1
    holds padding only. float32 sums over the same 10 or 6 terms, split in two: 1e-6."""
    vocabs = (VOCAB, 6)
    ranks = spawn(_on_two_tp_ranks, 2, vocabs)
    for i, vocab in enumerate(vocabs):
        logits, labels = _logits(vocab)
        logps, entropy, grad = _terms_and_grad(logits, labels, vocab)
        for r, per_rank in enumerate(ranks):
            got_logps, got_entropy, got_grad = per_rank[i]
            torch.testing.assert_close(got_logps, logps, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(got_entropy, entropy, rtol=1e-6, atol=1e-6)
            half = grad[..., r * PADDED // 2 : (r + 1) * PADDED // 2]
            torch.testing.assert_close(got_grad, half, rtol=1e-6, atol=1e-6)


def test_the_output_processor_gives_batch_major_terms(megatron_world):
    """`token_terms` runs the output layer on ``[s, b, hidden]`` and returns ``[b, s]``."""
    hidden = torch.randn(5, 3, 4)
    weight = torch.randn(PADDED, 4)
    labels = torch.randint(0, VOCAB, (3, 5))

    def output_layer(x, weight):
        return x @ weight.t(), None

    out = token_terms(
        hidden_states=hidden,
        output_layer=output_layer,
        output_weight=weight,
        labels=labels,
        context=VOCAB,
        entropy=True,
    )
    assert isinstance(out, TokenTerms) and out.logps.shape == out.entropy.shape == (3, 5)
    want = vocab_parallel_terms(hidden @ weight.t(), labels.t(), VOCAB, entropy=True)
    assert torch.equal(out.logps, want[0].t()) and torch.equal(out.entropy, want[1].t())


def _state(**options):
    model = tf.models.from_hf_config(
        tiny_config("qwen2"), seed=0, backend="megatron", options=options
    )
    return tf.init(model, tf.optim.adamw(1e-3))


def _hf_grads(state, grads):
    """`grads` (megatron names, one process) by HF checkpoint name."""
    placement = model_placement(state.model)
    local = {n: g.detach().clone() for n, g in grads.params.items()}
    named = mcore_to_hf(
        {(0, 0, 0): local},
        placement.hf_config,
        tp_size=1,
        pp_size=1,
        vocab_multiple=placement.vocab_multiple,
    )
    return dict(named)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_a_models_policy_gradient_equals_the_hf_models_in_float64(
    megatron_world, layout, monkeypatch
):
    """Two micro-batches each; per-token advantages, the entropy bonus on. At tensor-parallel
    size 1 the terms come from the fused, chunked projection: the logits path is never taken."""

    def no_logits(*args, **kwargs):
        raise AssertionError("tp 1 built the full logits")

    monkeypatch.setattr(token_terms_module, "vocab_parallel_terms", no_logits)
    feats = with_advantages(random_features(6, seed=3), seed=3)
    batch = pack(feats) if layout == "packed" else pad_collate(feats, pad_token_id=0)
    state = _state(num_micro_batches=2)
    grads, aux = tf.fwd_bwd(state, batch, loss=PG)
    got = _hf_grads(state, grads)
    module = tf.models.from_hf_config(tiny_config("qwen2"), seed=0).module.to(torch.float64)
    want_sum, want = policy_gradient_reference(module, feats, PG.entropy_coef)
    assert int(aux["num_tokens"]) == sum(x != -100 for f in feats for x in f["labels"])
    assert float(aux["loss_sum"]) == pytest.approx(float(want_sum), rel=1e-5)
    assert got.keys() == want.keys()
    for name, grad in got.items():
        torch.testing.assert_close(grad.double(), want[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_ppo_loss_equals_its_float64_reference_in_value_and_gradient(megatron_world, layout):
    """Every option on, two micro-batches: each per-token field (advantages, old, reference and
    rollout log-probs, loss weights) is split with its tokens. The clip binds on some tokens
    (the reference writes the surrogate piecewise, so a field misaligned by a token or a
    micro-batch changes which tokens it binds on, and the gradient). Tolerances of the policy
    gradient's (float32 here)."""
    feats = with_rl_fields(random_features(6, seed=3), seed=3)
    batch = pack(feats) if layout == "packed" else pad_collate(feats, pad_token_id=0)
    state = _state(num_micro_batches=2)
    grads, aux = tf.fwd_bwd(state, batch, loss=PPO)
    got = _hf_grads(state, grads)
    module = tf.models.from_hf_config(tiny_config("qwen2"), seed=0).module.to(torch.float64)
    want_sum, want = ppo_reference(module, feats, PPO)
    assert int(aux["num_tokens"]) == sum(x != -100 for f in feats for x in f["labels"])
    assert float(aux["loss_sum"]) == pytest.approx(float(want_sum), rel=1e-5)
    assert got.keys() == want.keys()
    for name, grad in got.items():
        torch.testing.assert_close(grad.double(), want[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize(
    "loss",
    [tf.losses.dpo_loss(0.5, label_smoothing=0.1), tf.losses.simpo_loss(2.5, 0.5)],
    ids=["dpo", "simpo"],
)
def test_a_preference_loss_equals_its_float64_reference_in_value_and_gradient(
    megatron_world, loss, layout
):
    """Three pairs over four micro-batches (2, 2, 1, 1 sequences: the last pair cut in two):
    the linearised token loss needs no pair on one micro-batch. Tolerances of the policy
    gradient's (float32 here); the count is the pairs."""
    feats = with_rl_fields(random_features(6, seed=11), seed=11)
    batch = pack(feats) if layout == "packed" else pad_collate(feats, pad_token_id=0)
    state = _state(num_micro_batches=4)
    grads, aux = tf.fwd_bwd(state, batch, loss=loss)
    got = _hf_grads(state, grads)
    module = tf.models.from_hf_config(tiny_config("qwen2"), seed=0).module.to(torch.float64)
    want_sum, want = preference_reference(module, feats, loss)
    assert int(aux["num_tokens"]) == 3
    assert float(aux["loss_sum"]) == pytest.approx(float(want_sum), rel=1e-5)
    assert got.keys() == want.keys()
    for name, grad in got.items():
        torch.testing.assert_close(grad.double(), want[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_weighted_cross_entropy_equals_its_float64_reference(megatron_world, layout):
    """Per-token loss scales (zeros included) over two micro-batches; tolerances of the policy
    gradient's (float32 here)."""
    feats = with_loss_scale(random_features(6, seed=13), seed=13)
    batch = pack(feats) if layout == "packed" else pad_collate(feats, pad_token_id=0)
    state = _state(num_micro_batches=2)
    grads, aux = tf.fwd_bwd(state, batch, loss=tf.losses.weighted_cross_entropy())
    got = _hf_grads(state, grads)
    module = tf.models.from_hf_config(tiny_config("qwen2"), seed=0).module.to(torch.float64)
    want_sum, want = weighted_ce_reference(module, feats)
    assert int(aux["num_tokens"]) == sum(x != -100 for f in feats for x in f["labels"])
    assert float(aux["loss_sum"]) == pytest.approx(float(want_sum), rel=1e-5)
    assert got.keys() == want.keys()
    for name, grad in got.items():
        torch.testing.assert_close(grad.double(), want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_micro_batches_and_accumulated_calls_of_a_token_loss_equal_one_batch(megatron_world):
    feats = with_advantages(random_features(6, seed=5), seed=5)
    out = {}
    for how in ("whole", "micro", "accum"):
        state = _state(num_micro_batches=3 if how == "micro" else 1)
        if how == "accum":
            grads, _ = tf.fwd_bwd(state, pack(feats[:2]), loss=PG)
            grads, _ = tf.fwd_bwd(state, pack(feats[2:]), grads, loss=PG)
        else:
            grads, _ = tf.fwd_bwd(state, pack(feats), loss=PG)
        out[how] = (grads.loss_sum, grads.num_tokens, _hf_grads(state, grads))
    whole_sum, whole_tokens, whole = out["whole"]
    for how in ("micro", "accum"):
        loss_sum, num_tokens, params = out[how]
        assert int(num_tokens) == int(whole_tokens)
        assert float(loss_sum) == pytest.approx(float(whole_sum), rel=1e-5)
        for name, grad in params.items():
            torch.testing.assert_close(grad, whole[name], rtol=0, atol=1e-6, msg=name)
