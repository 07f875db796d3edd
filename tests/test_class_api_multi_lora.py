"""`TransformersModel` with several named LoRA adapters (upstream's multi-adapter groups).

Two adapters on one model, each with its own optimizer, schedule and accumulation steps,
trained alternately, must end exactly where each ends when trained alone on a fresh model with
the same seeds and inputs: float64 and the same ops, so equality is bit-for-bit. The base
weights must not move; one adapter's save/load must round-trip without touching the other; the
saved directory must load in peft and give the model's logits.
"""

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from twinkle.model import TransformersModel
from twinkle_fn.testing import random_features, tiny_config

# name: config, init seed, optimizer, scheduler, accumulation steps
ADAPTERS = {
    "a": (
        {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"},
        1,
        ("AdamW", {"lr": 1e-2}),
        ("CosineWarmupScheduler", {"num_warmup_steps": 1, "num_training_steps": 4}),
        2,
    ),
    "b": (
        {"r": 2, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        2,
        ("AdamW", {"lr": 3e-2, "weight_decay": 0.0}),
        None,
        1,
    ),
}
STEPS = 3


# Layer 0's q_proj lora_B (zero until trained), in the module and in a peft adapter file.
Q_LORA_B = "model.layers.0.self_attn.q_proj.lora_B.{}.weight"
Q_LORA_B_FILE = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(names):
    """A fresh float64 model with adapters `names` added in order, each from its own seed and
    with its own settings."""
    model = TransformersModel(
        config=tiny_config(), mixed_precision="no", dtype=torch.float64, seed=0
    )
    for name in names:
        config, seed, _, _, gas = ADAPTERS[name]
        torch.manual_seed(seed)
        model.add_adapter_to_model(name, config, gradient_accumulation_steps=gas)
    for name in names:
        _, _, (optimizer, kwargs), scheduler, _ = ADAPTERS[name]
        model.set_optimizer(optimizer, adapter_name=name, **kwargs)
        if scheduler:
            model.set_lr_scheduler(scheduler[0], adapter_name=name, **scheduler[1])
    return model


def _feats(name, step, micro):
    return random_features(3, seed=100 * ord(name) + 10 * step + micro)


def _train(model, names):
    """STEPS optimizer steps per adapter, the adapters' micro-batches interleaved."""
    metrics = {name: [] for name in names}
    for step in range(STEPS):
        for micro in range(2):
            for name in names:
                gas = ADAPTERS[name][4]
                if micro >= gas:
                    continue
                model.forward_backward(inputs=_feats(name, step, micro), adapter_name=name)
                norm = model.clip_grad_and_step(max_grad_norm=1.0, adapter_name=name)
                assert (norm is None) == (micro + 1 < gas)
                if norm is not None:
                    metrics[name].append(model.calculate_metric(adapter_name=name))
    return metrics


def _weights(model, name):
    """A copy of adapter `name`'s weights (get_state_dict gives views of the live tensors)."""
    return {n: t.clone() for n, t in model.get_state_dict(adapter_name=name).items()}


def _base(model):
    return {n: p.detach().clone() for n, p in model.model.named_parameters() if ".lora_" not in n}


@pytest.fixture(scope="module")
def trained():
    model = _model("ab")
    base = _base(model)
    return model, base, _train(model, "ab")


@pytest.mark.parametrize("name", ["a", "b"])
def test_each_adapter_trains_as_if_alone(trained, name):
    model, _, metrics = trained
    alone = _model(name)
    expected = _train(alone, name)[name]
    assert metrics[name] == expected  # loss, grad_norm, lr, num_tokens, step: all equal
    assert [m["step"] for m in expected] == [1, 2, 3]
    state_dict, reference = model.get_state_dict(adapter_name=name), alone.get_state_dict()
    assert state_dict.keys() == reference.keys()
    assert all(f".lora_A.{name}." in n or f".lora_B.{name}." in n for n in state_dict)
    assert all(torch.equal(state_dict[n], reference[n]) for n in state_dict)
    assert int(model.state_of(name).step) == STEPS


def test_base_weights_are_bit_identical_and_lrs_differ(trained):
    model, base, metrics = trained
    after = _base(model)
    assert after.keys() == base.keys()
    assert all(torch.equal(after[n], base[n]) for n in base)
    assert metrics["a"][0]["lr"] != metrics["b"][0]["lr"]  # warmup cosine vs constant 3e-2
    assert "adapters: ['a', 'b']" in model.get_train_configs(adapter_name="a")


def test_save_and_load_one_adapter_round_trips_and_loads_in_peft(trained, tmp_path):
    model, _, _ = trained
    path = model.save("a-ckpt", output_dir=tmp_path, adapter_name="a")
    weights = load_file(f"{path}/adapter_model.safetensors")
    assert len(weights) == 2 * 2 * 7 and not any(".a." in k or ".b." in k for k in weights)

    fresh = _model("ab")
    untouched_b = _weights(fresh, "b")
    assert not torch.equal(fresh.get_state_dict("a")[Q_LORA_B.format("a")], weights[Q_LORA_B_FILE])
    fresh.load(path, adapter_name="a")
    loaded, saved = fresh.get_state_dict(adapter_name="a"), model.get_state_dict(adapter_name="a")
    assert all(torch.equal(loaded[n], saved[n]) for n in saved)
    after_b = fresh.get_state_dict(adapter_name="b")
    assert all(torch.equal(after_b[n], untouched_b[n]) for n in untouched_b)

    feats = random_features(2, min_len=8, max_len=8, seed=7)
    ids = torch.tensor([f["input_ids"] for f in feats])
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(plain.to(torch.float64), path)
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits  # [2, 8, vocab]
    for m in (model, fresh):
        logits = m.forward_only(inputs=feats, adapter_name="a", return_logits=True)["logits"]
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-10)
    other = model.forward_only(inputs=feats, adapter_name="b", return_logits=True)["logits"]
    assert (other - expected).abs().max() > 1e-3  # adapter b computes something else


def test_resuming_one_adapter_leaves_the_other_as_it_is(tmp_path):
    model = _model("ab")
    _train(model, "ab")
    path = model.save("b-ckpt", output_dir=tmp_path, save_optimizer=True, adapter_name="b")
    saved_b, a_before = _weights(model, "b"), _weights(model, "a")
    for micro in range(2):  # a moves on, b takes a step to be undone
        model.forward_backward(inputs=_feats("a", 9, micro), adapter_name="a")
        model.clip_grad_and_step(adapter_name="a")
    model.forward_backward(inputs=_feats("b", 9, 0), adapter_name="b")
    model.clip_grad_and_step(adapter_name="b")
    a_now = _weights(model, "a")
    qa, qb = Q_LORA_B.format("a"), Q_LORA_B.format("b")
    assert not torch.equal(a_now[qa], a_before[qa])
    assert not torch.equal(model.get_state_dict("b")[qb], saved_b[qb])
    info = model.resume_from_checkpoint(path, adapter_name="b")
    assert info["cur_step"] == STEPS and int(model.state_of("b").step) == STEPS
    assert int(model.state_of("a").step) == STEPS + 1
    b_back, a_after = model.get_state_dict(adapter_name="b"), model.get_state_dict("a")
    assert all(torch.equal(b_back[n], saved_b[n]) for n in saved_b)
    assert all(torch.equal(a_after[n], a_now[n]) for n in a_now)


def test_adapter_names_are_checked():
    model = _model("ab")
    with pytest.raises(ValueError, match=r"adapter 'b' already exists \(adapters: \['a', 'b'\]\)"):
        model.add_adapter_to_model("b", ADAPTERS["b"][0])
    with pytest.raises(
        ValueError, match=r"'c' does not exist; this model has adapters \['a', 'b'\]"
    ):
        model.get_state_dict(adapter_name="c")
    with pytest.raises(ValueError, match=r"'c' does not exist"):
        model.save("x", adapter_name="c")
    # Without a name, calls go to the adapter added last (upstream's active group).
    assert model.get_state_dict().keys() == model.get_state_dict(adapter_name="b").keys()
