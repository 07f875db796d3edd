"""The functional API on one process: accumulation, purity, donation, packing, errors."""

import pytest
import torch

import twinkle_fn as tf
from twinkle_fn import backends
from twinkle_fn.data import pack, pad_collate
from twinkle_fn.pytree import tree_leaves
from twinkle_fn.testing import random_features, tiny_config


def _model(family="qwen2", seed=0):
    return tf.models.from_hf_config(tiny_config(family), seed=seed, device="cpu")


def _state(model=None, lr=1e-2, dtype=torch.float64):
    model = model or _model()
    model.module.to(dtype)
    tx = tf.optim.chain(tf.optim.clip_by_global_norm(1.0), tf.optim.adamw(lr))
    return tf.init(model, tx, seed=3)


def _collate(feats, packed):
    return pack(feats) if packed else pad_collate(feats, pad_token_id=0)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_k_micro_batches_equal_one_batch(packed):
    """Accumulating k micro-batches gives the grads and update of one batch of all their tokens.

    float64: both paths sum the same token losses in a different order, so they agree to ~1e-12.
    """
    feats = random_features(6, seed=1)
    state = _state()
    one, _ = tf.fwd_bwd(state, _collate(feats, packed), donate=False)
    acc = None
    for part in (feats[:1], feats[1:4], feats[4:]):
        acc, _ = tf.fwd_bwd(state, _collate(part, packed), accum=acc)
    assert int(acc.num_tokens) == int(one.num_tokens)
    assert acc.num_micro_batches == 3
    torch.testing.assert_close(acc.loss_sum, one.loss_sum, rtol=1e-12, atol=0)
    for name in one.params:
        torch.testing.assert_close(acc.params[name], one.params[name], rtol=1e-10, atol=1e-12)
    s1, i1 = tf.step(state, one, donate=False)
    s2, i2 = tf.step(state, acc, donate=False)
    torch.testing.assert_close(i1["loss"], i2["loss"], rtol=1e-12, atol=0)
    for name in s1.params:
        torch.testing.assert_close(s1.params[name], s2.params[name], rtol=1e-10, atol=1e-12)


def test_packed_equals_padded():
    """Padding-free packing computes the same loss and grads as right padding (float64)."""
    feats = random_features(5, seed=2)
    state = _state()
    g_pad, _ = tf.fwd_bwd(state, pad_collate(feats, pad_token_id=0))
    g_pack, _ = tf.fwd_bwd(state, pack(feats))
    torch.testing.assert_close(g_pack.loss_sum, g_pad.loss_sum, rtol=1e-12, atol=0)
    for name in g_pad.params:
        torch.testing.assert_close(g_pack.params[name], g_pad.params[name], rtol=1e-9, atol=1e-12)


def test_loss_matches_transformers_own_loss():
    """The fused loss equals transformers' CausalLM loss (mean CE over shifted labels)."""
    feats = random_features(4, seed=4)
    state = _state()
    batch = pad_collate(feats, pad_token_id=0)
    out = tf.evaluate(state, batch)
    logits = state.model.module(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
    ).logits
    ref = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, reduction="sum"
    )
    torch.testing.assert_close(out.loss_sum.double(), ref.double(), rtol=1e-10, atol=0)


def test_donate_false_leaves_inputs_bit_identical():
    state = _state()
    batch = pack(random_features(3))
    before = [t.clone() for t in tree_leaves(state)]
    grads, _ = tf.fwd_bwd(state, batch, donate=False)
    grads2, _ = tf.fwd_bwd(state, batch, accum=grads, donate=False)
    g_before = [t.clone() for t in tree_leaves(grads)]
    new, _ = tf.step(state, grads2, donate=False)
    assert not state.donated and not grads.donated
    for a, b in zip(before, tree_leaves(state), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(g_before, tree_leaves(grads), strict=True):
        assert torch.equal(a, b)
    assert int(new.step) == 1 and int(state.step) == 0
    assert any(
        not torch.equal(a, b)
        for a, b in zip(state.params.values(), new.params.values(), strict=False)
    )


def test_donation_blocks_reuse():
    state = _state()
    batch = pack(random_features(3))
    grads, _ = tf.fwd_bwd(state, batch)
    grads2, _ = tf.fwd_bwd(state, batch, accum=grads)
    with pytest.raises(tf.DonatedError, match="fwd_bwd"):
        tf.fwd_bwd(state, batch, accum=grads)
    new, _ = tf.step(state, grads2)
    with pytest.raises(tf.DonatedError, match="step"):
        tf.fwd_bwd(state, batch)
    with pytest.raises(tf.DonatedError):
        tf.step(state, grads2)
    grads3, _ = tf.fwd_bwd(new, batch)
    tf.step(new, grads3)


def test_donated_and_copied_steps_agree():
    batch = pack(random_features(4))
    state = _state()
    copy_state, _ = tf.step(state, tf.fwd_bwd(state, batch)[0], donate=False)
    donated_state, _ = tf.step(state, tf.fwd_bwd(state, batch)[0])
    for name in copy_state.params:
        assert torch.equal(copy_state.params[name], donated_state.params[name])


def test_training_reduces_loss_and_reports_info():
    feats = random_features(8, seed=5)
    state = _state(lr=3e-2)
    batch = pack(feats)
    first = None
    for _ in range(15):
        grads, _ = tf.fwd_bwd(state, batch)
        state, info = tf.step(state, grads)
        first = first if first is not None else float(info["loss"])
    assert float(info["loss"]) < 0.7 * first
    assert set(info) == {"loss", "grad_norm", "num_tokens", "lr"}
    assert info["lr"] == pytest.approx(3e-2)
    assert int(state.step) == 15


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "mistral"])
def test_every_family_trains_a_step(family):
    # float32: the MoE experts run torch._grouped_mm, which has no float64 kernel.
    state = _state(_model(family), dtype=torch.float32)
    grads, aux = tf.fwd_bwd(state, pack(random_features(3)))
    assert torch.isfinite(grads.loss_sum) and int(aux["num_tokens"]) > 0
    _new, info = tf.step(state, grads)
    assert torch.isfinite(info["grad_norm"])


def test_shard_on_one_process_is_identity_and_refuses_bigger_meshes():
    state = _state()
    assert tf.shard(state, tf.Mesh()) is state
    with pytest.raises(ValueError, match="2 ranks but the world has 1"):
        tf.shard(state, tf.Mesh(dp=2))
    with pytest.raises(ValueError, match="2 ranks but the world has 1"):
        tf.init(_model(), tf.optim.adamw(1e-3), tf.Mesh(tp=2))


def test_init_rejects_a_model_without_trainable_params():
    model = _model()
    model.module.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        tf.init(model, tf.optim.adamw(1e-3))


def test_frozen_params_stay_out_of_the_state():
    model = _model()
    model.module.get_input_embeddings().weight.requires_grad_(False)
    state = tf.init(model, tf.optim.adamw(1e-3))
    assert "model.embed_tokens.weight" not in state.params
    frozen = model.module.get_input_embeddings().weight.clone()
    state, _ = tf.step(state, tf.fwd_bwd(state, pack(random_features(2)))[0])
    assert torch.equal(model.module.get_input_embeddings().weight, frozen)


def test_activation_checkpointing_gives_the_same_grads():
    """Recomputing layers in backward changes memory, not values (float64: bit-for-bit here)."""
    batch = pack(random_features(4, seed=9))
    grads = []
    for ckpt in (False, True):
        model = tf.models.from_hf_config(
            tiny_config(), seed=0, device="cpu", activation_checkpointing=ckpt
        )
        grads.append(tf.fwd_bwd(_state(model), batch)[0])
    for name, g in grads[0].params.items():
        torch.testing.assert_close(grads[1].params[name], g, rtol=1e-12, atol=0)


def test_shard_and_unshard_of_bare_params_on_one_process():
    """Without a process group the pieces are rank 0's; joining them needs every rank's."""
    model = _model()
    full = dict(model.module.state_dict())
    same = tf.shard(full, tf.Mesh(), model)
    assert all(torch.equal(same[n], full[n]) for n in full)
    back = tf.unshard(same, tf.Mesh(), model)
    assert back.keys() == full.keys() and all(torch.equal(back[n], full[n]) for n in full)
    q = "model.layers.0.self_attn.q_proj.weight"
    mine = tf.shard(full, tf.Mesh(tp=2), model)
    assert torch.equal(mine[q], full[q][:16])
    assert torch.equal(mine["model.norm.weight"], full["model.norm.weight"])  # not in the plan
    with pytest.raises(ValueError, match=r"missing \[1\]"):
        tf.unshard(mine, tf.Mesh(tp=2), model)


def test_shard_and_unshard_dispatch_on_the_first_argument():
    state = _state()
    full = dict(state.model.module.state_dict())
    with pytest.raises(TypeError, match="needs the model the params belong to"):
        tf.shard(full, tf.Mesh())
    with pytest.raises(TypeError, match="takes no model"):
        tf.shard(state, tf.Mesh(), state.model)
    with pytest.raises(TypeError, match="needs the mesh and model"):
        tf.unshard(full, tf.Mesh())
    with pytest.raises(TypeError, match="takes no mesh or model"):
        tf.unshard(state, tf.Mesh(), state.model)
    assert tf.unshard(state).keys() == state.params.keys()


def test_a_loss_that_cannot_run_is_refused_before_compute(monkeypatch):
    """A missing field, a request for value estimates, or what is not a loss: the backend is
    never reached and `accum` is not donated."""
    state = _state()
    feats = random_features(3, seed=4)
    accum, _ = tf.fwd_bwd(state, pack(feats))

    def no_compute(*args):
        raise AssertionError("the backend computed")

    monkeypatch.setattr(type(backends.get(state.model.backend)), "fwd_bwd", no_compute)
    # a sequence loss's first pass
    monkeypatch.setattr(type(backends.get(state.model.backend)), "token_logps", no_compute)
    critic = tf.losses.token_loss(lambda inputs: None, needs=["values"])
    for loss, error, match in (
        (tf.losses.policy_gradient(), ValueError, "reads batch field 'advantages'"),
        (critic, ValueError, "this model has no value head"),
        (lambda inputs: None, TypeError, "must be a TokenLoss"),
        (tf.losses.simpo_loss(), ValueError, "3 packed samples, an odd number"),
    ):
        with pytest.raises(error, match=match):
            tf.fwd_bwd(state, pack(feats), accum, loss=loss)
    accum.check_alive()
