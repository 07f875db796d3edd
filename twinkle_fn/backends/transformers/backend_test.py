import pytest
import torch

import twinkle_fn as tf
from twinkle_fn import backends
from twinkle_fn.backends.transformers.backend import TransformersBackend
from twinkle_fn.data import pack, pad_collate
from twinkle_fn.testing import no_host_sync, random_features, tiny_config, with_rl_fields


def test_registry_names_and_errors():
    assert backends.names() == ("transformers", "megatron")
    assert isinstance(backends.get("transformers"), TransformersBackend)
    assert isinstance(backends.get("fsdp"), TransformersBackend)  # the older name
    assert tf.models.from_hf_config(tiny_config(), backend="fsdp").backend == "transformers"
    with pytest.raises(ValueError, match="unknown backend 'jax'"):
        backends.get("jax")


def test_prepare_is_a_no_op_on_one_process_and_trainable_follows_requires_grad():
    be = TransformersBackend()
    model = tf.models.from_hf_config(tiny_config(), seed=0, device="cpu")
    assert be.prepare(model, tf.Mesh()) is model
    model.module.get_decoder().norm.weight.requires_grad_(False)
    assert "model.norm.weight" not in be.trainable(model)


@pytest.mark.parametrize(
    ("precision", "dtype"), [("bf16", torch.bfloat16), ("fp32", torch.float32)]
)
def test_the_residual_stream_runs_in_the_compute_dtype(precision, dtype):
    """Like FSDP2's mixed precision on several ranks: the decoder layers get compute-dtype
    hidden states on one process too, while the master weights stay float32."""
    model = tf.models.from_hf_config(tiny_config(), seed=0, device="cpu", precision=precision)
    state = tf.init(model, tf.optim.sgd(0.1))
    tf.init(model, tf.optim.sgd(0.1))  # preparing twice adds no second cast
    seen = []
    layer = model.module.get_decoder().layers[1]
    layer.register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append(args[0].dtype), with_kwargs=True
    )
    tf.fwd_bwd(state, pack(random_features(2)))
    assert seen == [dtype]
    assert len(model.module.get_input_embeddings()._forward_hooks) == 1
    assert all(p.dtype == torch.float32 for p in state.params.values())
    with torch.no_grad():  # outside autocast the module is a plain float32 model
        hidden = model.module.get_decoder()(torch.tensor([[1, 2, 3]])).last_hidden_state
    assert hidden.dtype == torch.float32


def test_update_normalises_by_the_token_count_once():
    """A batch's summed gradients divided by its token count are the mean-loss gradients."""
    be = TransformersBackend()
    model = tf.models.from_hf_config(tiny_config(), seed=0, device="cpu")
    model.module.to(torch.float64)
    state = tf.init(model, tf.optim.sgd(1.0))
    batch = pack(random_features(3))
    grads, _ = tf.fwd_bwd(state, batch)
    n = int(grads.num_tokens)
    before = {k: p.detach().clone() for k, p in state.params.items()}
    expected = {k: before[k] - g / n for k, g in grads.params.items()}
    new, info = be.update(state.replace(), grads.replace())
    for k in expected:
        torch.testing.assert_close(new.params[k], expected[k], rtol=1e-12, atol=1e-15)
    assert int(info["num_tokens"]) == n


def test_a_pending_token_scale_trains_as_multiplying_first():
    """With clip then AdamW (both take a `ScaledUpdates`) the token normalisation and the clip
    stay pending until AdamW reads each gradient; the same optimizer hiding that it takes one
    multiplies first. Three float32 steps agree to float32 rounding (the norm is the unscaled
    tree's times the factor), and the reported norm too. An eps near the gradients' size makes
    AdamW's update depend on their scale (it would hide a wrong one otherwise), and the clip
    threshold lies among the steps' norms (1.81-2.33): it acts on some steps only."""
    runs = []
    for hide in (False, True):
        model = tf.models.from_hf_config(tiny_config(), seed=0, device="cpu")
        tx = tf.optim.chain(tf.optim.clip_by_global_norm(2.0), tf.optim.adamw(1e-2, eps=1e-3))
        tx = tx._replace(takes_scaled=False) if hide else tx
        state = tf.init(model, tx)
        norms = []
        for seed in (1, 2, 3):
            grads, _ = tf.fwd_bwd(state, pack(random_features(4, seed=seed)))
            state, info = tf.step(state, grads)
            norms.append(info["grad_norm"])
        runs.append((state.params, norms))
    (deferred, norms), (first, ref_norms) = runs
    assert min(ref_norms) < 2.0 < max(ref_norms), "the clip should act on some steps only"
    torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=0)
    for k, p in deferred.items():
        torch.testing.assert_close(p, first[k], rtol=1e-5, atol=1e-6, msg=k)


def _two_steps(options):
    model = tf.models.from_hf_config(tiny_config(), seed=0, device="cpu", options=options)
    state = tf.init(model, tf.optim.adamw(1e-2))
    losses = []
    for seed in (1, 2):
        grads, _ = tf.fwd_bwd(state, pack(random_features(4, seed=seed)))
        state, info = tf.step(state, grads)
        losses.append(float(info["loss"]))
    return state, losses


def test_compile_layers_compiles_each_decoder_layer_and_changes_no_number():
    """With dynamo's eager backend the compiled layers run the very same kernels: bit-exact
    (inductor's fused kernels are what the GPU benchmark measures)."""
    plain, plain_losses = _two_steps({})
    compiled, losses = _two_steps({"compile_layers": {"backend": "eager"}})
    layers = compiled.model.module.get_decoder().layers
    assert all(layer._compiled_call_impl is not None for layer in layers)
    assert losses == plain_losses
    for name, p in compiled.params.items():
        assert torch.equal(p, plain.params[name]), name


def test_compile_layers_rejects_other_values():
    model = tf.models.from_hf_config(tiny_config(), seed=0, options={"compile_layers": "yes"})
    with pytest.raises(TypeError, match="compile_layers must be True, False or a dict"):
        tf.init(model, tf.optim.adamw(1e-2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("loss", ["cross entropy", "ppo"])
@pytest.mark.parametrize("layout", ["packed", "full rows"])
def test_a_training_step_on_cuda_never_syncs_the_host(layout, loss):
    """fwd_bwd and step of a CPU batch queue all their work: nothing waits on the device, so the
    host runs ahead (the loss's supervised rows are counted on the CPU, before the forward).
    Full rows take the decoder's own causal mask (a qwen2 decoder is handed it ready-made). A
    token loss (PPO with every term, the entropy too) reads its terms from the chunked head
    without a sync either."""
    model = tf.models.from_hf_config(tiny_config(), seed=0, device="cuda", precision="bf16")
    state = tf.init(model, tf.optim.adamw(1e-3))
    feats = random_features(4, min_len=12, max_len=12, seed=1)
    token_loss = None
    if loss == "ppo":
        feats = with_rl_fields(feats)
        token_loss = tf.losses.ppo_loss(0.2, 0.28, beta=0.04, entropy_coef=0.01, tis_cap=2.0)
    batch = pack(feats) if layout == "packed" else pad_collate(feats, pad_token_id=0)
    warm = tf.fwd_bwd(state, batch, loss=token_loss)[0]
    state, _ = tf.step(state, warm)  # warm-up: lazy inits may sync
    with no_host_sync():
        grads, _ = tf.fwd_bwd(state, batch, loss=token_loss)
        state, info = tf.step(state, grads)
    assert torch.isfinite(info["loss"]) and torch.isfinite(info["grad_norm"])


def test_master_weights_off_stores_every_parameter_in_the_compute_dtype():
    """``master_weights=False``: every parameter in bf16 (2 bytes each); a non-bool is refused
    before anything is cast."""
    model = tf.models.from_hf_config(
        tiny_config("qwen2"),
        seed=0,
        precision="bf16",
        device="cpu",
        options={"master_weights": False},
    )
    numel = sum(p.numel() for p in model.module.parameters())
    state = tf.init(model, tf.optim.adamw_bf16(1e-3))
    assert {p.dtype for p in state.model.module.parameters()} == {torch.bfloat16}
    assert sum(p.numel() * p.element_size() for p in state.params.values()) == 2 * numel
    bad = tf.models.from_hf_config(
        tiny_config("qwen2"),
        seed=0,
        precision="bf16",
        device="cpu",
        options={"master_weights": "no"},
    )
    with pytest.raises(ValueError, match="master_weights must be a bool, got 'no'"):
        tf.init(bad, tf.optim.adamw(1e-3))
    assert {p.dtype for p in bad.module.parameters()} == {torch.float32}
