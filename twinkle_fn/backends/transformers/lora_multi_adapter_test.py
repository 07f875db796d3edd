"""LoRA with several named adapters on one model: each stepped by its own state trains exactly as
it would alone, on one process and on fsdp2, each export loads in peft next to the others, and
misuse (an unknown, dotted or half-added adapter, a state over two adapters) is refused."""

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

import twinkle_fn as tf
from twinkle_fn import lora
from twinkle_fn.backends.transformers.lora import adapters_of
from twinkle_fn.backends.transformers.lora_test import CFG, _logits, _model
from twinkle_fn.data import pack
from twinkle_fn.distributed import rank
from twinkle_fn.testing import random_features, tiny_config
from twinkle_fn.testing_dist import spawn

CFG_B = {"r": 2, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
TWO = {"a": (CFG, 1, 1e-2), "b": (CFG_B, 2, 3e-2)}  # name: config, init seed, lr


def _with_adapters(names):
    """A fresh model with adapters `names` added in order, each from its own seed."""
    model = _model()
    for name in names:
        torch.manual_seed(TWO[name][1])
        model = lora.add_lora(model, TWO[name][0], name)
    return model


def _lora_step(state, i):
    grads, _ = tf.fwd_bwd(state, pack(random_features(4, seed=20 + i)))
    return grads, *tf.step(state, grads)


def test_adapters_on_one_model_train_exactly_as_each_alone(tmp_path):
    """Adapters a and b on one module, stepped alternately by their own states, end bit-equal
    (float64, same ops) to each trained alone on a fresh model; base weights never move; each
    export loads in peft next to the other and reproduces that adapter's logits."""
    model = _with_adapters("ab")
    module = model.module
    assert lora.adapter_names(module) == ["a", "b"]
    base = {n: p.detach().clone() for n, p in module.named_parameters() if ".lora_" not in n}
    states = {}
    for name, (_, _, lr) in TWO.items():
        lora.set_adapter(model, name)
        states[name] = tf.init(model, tf.optim.adamw(lr))
        assert adapters_of(states[name].params) == [name]
    losses = {name: [] for name in TWO}
    for i in range(2):
        for name in TWO:
            _, states[name], info = _lora_step(states[name], i)
            losses[name].append(float(info["loss"]))
            assert all(p.grad is None for p in module.parameters())
    evals = {name: tf.evaluate(states[name], pack(random_features(4, seed=9))) for name in "ba"}
    for name in TWO:
        alone = tf.init(_with_adapters(name), tf.optim.adamw(TWO[name][2]))
        ref = []
        for i in range(2):
            _, alone, info = _lora_step(alone, i)
            ref.append(float(info["loss"]))
        assert losses[name] == ref
        trained, expected = tf.unshard(states[name]), tf.unshard(alone)
        assert trained.keys() == expected.keys()
        assert all(torch.equal(trained[n], expected[n]) for n in trained)
        assert torch.equal(
            evals[name].loss_sum, tf.evaluate(alone, pack(random_features(4, seed=9))).loss_sum
        )
    assert all(torch.equal(p, base[n]) for n, p in module.named_parameters() if n in base)

    for name in TWO:
        lora.save_adapter(states[name], tmp_path / name)
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(tiny_config("qwen2"), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(plain.to(torch.float64), tmp_path / "a", "a")
    peft_model.load_adapter(tmp_path / "b", "b")
    for name in "ba":
        peft_model.set_adapter(name)
        lora.set_adapter(model, name)
        logits = _logits(peft_model)
        torch.testing.assert_close(logits, _logits(module), rtol=0, atol=1e-10)
        with peft_model.disable_adapter():  # the adapter was loaded, not silently skipped
            assert (_logits(peft_model) - logits).abs().max() > 1e-3


def _train_two(mesh_sizes):
    """Adapters a and b stepped alternately on `mesh_sizes`, each rank on its slice."""
    mesh = tf.Mesh(**mesh_sizes)
    model = _with_adapters("ab")
    states = {}
    for name, (_, _, lr) in TWO.items():
        lora.set_adapter(model, name)
        states[name] = tf.init(model, tf.optim.adamw(lr), mesh)
        model = states[name].model  # the first init sharded the module; the rest share it
    losses = {name: [] for name in TWO}
    for i in range(2):
        for name in TWO:
            feats = random_features(8, seed=30 + i)
            mine = feats[mesh.get_slice(len(feats), rank())] if mesh.world_size > 1 else feats
            grads, _ = tf.fwd_bwd(states[name], pack(mine))
            states[name], info = tf.step(states[name], grads)
            losses[name].append(float(info["loss"]))
    return losses, {name: tf.unshard(states[name]) for name in TWO}


def test_several_adapters_on_fsdp2_match_one_process():
    """FSDP2 shards every adapter with the module while each state trains its own (float64;
    tolerances as in `test_mesh_matches_one_process`, observed ~1e-15)."""
    ref_losses, ref_weights = _train_two({})
    for losses, weights in spawn(_train_two, 2, {"fsdp": 2}):
        for name in TWO:
            assert losses[name] == pytest.approx(ref_losses[name], rel=1e-11)
            assert weights[name].keys() == ref_weights[name].keys()
            for n, p in weights[name].items():
                torch.testing.assert_close(p, ref_weights[name][n], rtol=1e-9, atol=1e-11)


def test_several_adapters_misuse_raises():
    model = _with_adapters("a")
    with pytest.raises(ValueError, match=r"'b' does not exist; this model has adapters \['a'\]"):
        lora.set_adapter(model, "b")
    with pytest.raises(ValueError, match=r"without '\.'"):
        lora.add_lora(model, CFG, "x.y")
    with pytest.raises(ValueError, match="no_such_proj"):
        lora.add_lora(model, {**CFG, "target_modules": ["no_such_proj"]}, "b")
    assert lora.adapter_names(model.module) == ["a"]  # the failed add left nothing behind
    model = lora.add_lora(model, CFG_B, "b")
    for n, p in model.module.named_parameters():  # a state over both adapters' weights
        p.requires_grad_(".lora_" in n)
    both = tf.init(model, tf.optim.adamw(1e-2))
    with pytest.raises(ValueError, match=r"weights of adapters \['a', 'b'\]"):
        lora.adapter_state_dict(both)
