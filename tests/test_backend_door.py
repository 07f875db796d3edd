"""What the core asks of a backend works the same on both: per-token log-probs, the gradient norm
(under an fp16 loss scale: `twinkle_fn/backends/transformers/loss_scale_test.py`),
HF weights in, LoRA through `tf.lora`, and megatron's optimizer from `tf.optim`.

The megatron cases run in one spawned gloo process (megatron-core's parallel state is global to a
process). Tolerances: float64 runs agree to 1e-12 (the same terms summed in another order); the
megatron backend computes in float32 (and rounds the embedding lookup through its own layers), so
its log-probs agree with the transformers backend's on the same weights to 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import twinkle_fn as tf
from twinkle_fn.data import pack, pad_collate
from twinkle_fn.testing import random_features, tiny_config
from twinkle_fn.testing_dist import spawn

LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "init_lora_weights": False}


def _model(backend="transformers", dtype=torch.float64, seed=0):
    model = tf.models.from_hf_config(tiny_config("qwen2"), seed=seed, backend=backend, device="cpu")
    model.module.to(dtype)
    return model


def _reference_logps(module, batch, temperature):
    """float64 ``log softmax(logits / T)[label]`` of a padded batch, 0 on ignored labels."""
    with torch.no_grad():
        logits = module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logps = torch.log_softmax(logits.double() / temperature, dim=-1)  # [B, T, V]
    labels = batch["labels"]
    picked = logps.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return picked.masked_fill(labels == -100, 0.0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logps_match_a_float64_reference(temperature):
    state = tf.init(_model(), tf.optim.adamw(1e-3))
    feats = random_features(4, seed=5)
    batch = pad_collate(feats, pad_token_id=0)
    out = tf.token_logps(state, batch, temperature=temperature, return_logits=True)
    ref = _reference_logps(state.model.module, batch, temperature)
    torch.testing.assert_close(out["logps"].double(), ref, rtol=1e-12, atol=1e-12)
    assert out["logits"].shape == (*batch["labels"].shape, tiny_config("qwen2").vocab_size)
    loss = tf.evaluate(state, batch)
    torch.testing.assert_close(out["loss_sum"].double(), loss.loss_sum.double(), rtol=1e-12, atol=0)
    assert int(out["num_tokens"]) == int(loss.num_tokens)
    packed = tf.token_logps(state, pack(feats), temperature=temperature)["logps"]  # [1, T]
    assert torch.allclose(packed.double().sum(), ref.sum(), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="temperature must be a positive number"):
        tf.token_logps(state, batch, temperature=0)


def test_token_logps_without_lora_are_the_base_models():
    base = tf.init(_model(), tf.optim.adamw(1e-3))
    batch = pad_collate(random_features(3, seed=6), pad_token_id=0)
    expected = tf.token_logps(base, batch)["logps"]
    with_lora = tf.init(tf.lora.add_lora(_model(), LORA), tf.optim.adamw(1e-3))
    adapted = tf.token_logps(with_lora, batch)["logps"]
    assert not torch.allclose(adapted, expected)  # B starts random: the adapter counts
    torch.testing.assert_close(
        tf.token_logps(with_lora, batch, disable_lora=True)["logps"], expected
    )


def test_grad_norm_is_the_norm_step_reports():
    state = tf.init(_model(), tf.optim.adamw(1e-3))
    grads, _ = tf.fwd_bwd(state, pack(random_features(4, seed=7)))
    norm = tf.grad_norm(state, grads)
    _, info = tf.step(state, grads)
    torch.testing.assert_close(norm.double(), info["grad_norm"].double(), rtol=1e-6, atol=0)


def test_load_weights_copies_an_hf_checkpoint_into_the_state(tmp_path):
    donor = _model(seed=1).module
    donor.save_pretrained(tmp_path)
    state = tf.init(_model(seed=0), tf.optim.adamw(1e-3))
    step = state.step.clone()
    tf.checkpoint.load_weights(state, tmp_path)
    expected = donor.state_dict()
    for name, p in state.params.items():
        assert torch.equal(p, expected[name]), name
    assert torch.equal(state.step, step)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"holds no \.safetensors"):
        tf.checkpoint.load_weights(state, tmp_path / "empty")


def _megatron_door(tmp):
    """The door on the megatron backend, one process: log-probs against the transformers
    backend, HF weights in, the optimizer from tf.optim, and LoRA through tf.lora."""
    out = {}
    batch = pad_collate(random_features(3, seed=8), pad_token_id=0)
    hf = tf.init(_model(dtype=torch.float32), tf.optim.adamw(1e-3))
    meg = tf.init(_model("megatron", torch.float32), tf.optim.megatron_optimizer(1e-3))
    out["logps"] = (tf.token_logps(meg, batch)["logps"], tf.token_logps(hf, batch)["logps"])
    for name, kwargs in {
        "temperature": {"temperature": 0.5},
        "logits": {"return_logits": True},
    }.items():
        try:
            tf.token_logps(meg, batch, **kwargs)
        except ValueError as e:
            out[f"refused-{name}"] = str(e)
    grads, _ = tf.fwd_bwd(meg, batch)
    try:
        tf.grad_norm(meg, grads)
    except ValueError as e:
        out["refused-grad-norm"] = str(e)
    meg, info = tf.step(meg, grads)
    out["stepped"] = bool(torch.isfinite(info["grad_norm"]))
    _model(dtype=torch.float32, seed=1).module.save_pretrained(tmp / "donor")
    tf.checkpoint.load_weights(meg, tmp / "donor")
    out["loaded"] = tf.unshard(meg)
    model = tf.lora.add_lora(_model("megatron", torch.float32), LORA, "mine")
    out["adapter_names"] = tf.lora.adapter_names(model)
    state = tf.init(model, tf.optim.megatron_optimizer(1e-3))
    out["adapter"] = tf.lora.adapter_state_dict(state)
    tf.lora.save_adapter(state, tmp / "adapter")
    out["lora_logps"] = tf.token_logps(state, batch)["logps"]
    out["batch"] = batch
    return out


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("door")
    return spawn(_megatron_door, 1, tmp, timeout_s=300)[0], tmp


def test_megatron_token_logps_match_the_transformers_backend(megatron):
    out, _ = megatron
    meg, hf = out["logps"]
    torch.testing.assert_close(meg, hf, rtol=1e-5, atol=1e-5)
    assert "temperature 1" in out["refused-temperature"] and "logits" in out["refused-logits"]
    assert "info['grad_norm']" in out["refused-grad-norm"] and out["stepped"]


def test_megatron_loads_hf_weights(megatron):
    out, _ = megatron
    expected = _model(dtype=torch.float32, seed=1).module.state_dict()
    for name, tensor in out["loaded"].items():
        assert torch.equal(tensor, expected[name]), name


def test_megatron_lora_through_tf_lora_loads_in_peft(megatron):
    out, tmp = megatron
    assert out["adapter_names"] == ["mine"]
    files = load_file(tmp / "adapter" / "adapter_model.safetensors")
    assert files.keys() == out["adapter"].keys()
    torch.manual_seed(0)  # the base weights of tf.models.from_hf_config(..., seed=0)
    base = AutoModelForCausalLM.from_config(tiny_config("qwen2"), dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(base, tmp / "adapter").eval()
    batch = out["batch"]
    with torch.no_grad():
        logits = peft(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logps = torch.log_softmax(logits.float(), dim=-1)
    picked = logps.gather(-1, batch["labels"].clamp(min=0).unsqueeze(-1)).squeeze(-1)
    picked = picked.masked_fill(batch["labels"] == -100, 0.0)
    torch.testing.assert_close(out["lora_logps"], picked, rtol=1e-5, atol=1e-5)


def test_the_transformers_backend_offers_its_own_adamw():
    from twinkle_fn import backends

    tx = backends.get("transformers").optimizer(1e-3, clip_grad=0.5, weight_decay=0.0)
    state = tf.init(_model(), tx)
    grads, _ = tf.fwd_bwd(state, pack(random_features(2, seed=9)), donate=False)
    ref = tf.init(
        _model(),
        tf.optim.chain(tf.optim.clip_by_global_norm(0.5), tf.optim.adamw(1e-3, weight_decay=0.0)),
    )
    new, _ = tf.step(state, grads)
    ref, _ = tf.step(ref, tf.fwd_bwd(ref, pack(random_features(2, seed=9)))[0])
    for name in new.params:
        torch.testing.assert_close(new.params[name], ref.params[name], rtol=0, atol=0)
    with pytest.raises(ValueError, match="loss scale in the train state"):
        backends.get("transformers").optimizer(1e-3, loss_scale=128.0)
