"""LoRA: only adapters train, one process and gloo meshes agree, the export loads in peft, and a
bf16 model stores its frozen matrices in bf16 without changing a value. Several adapters on one
model are ``lora_multi_adapter_test``'s."""

import os

import pytest
import torch
from peft import LoraConfig, PeftModel
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

import twinkle_fn as tf
from twinkle_fn import lora
from twinkle_fn.backends.transformers.lm_head import FusedLMHead
from twinkle_fn.backends.transformers.plans import local_specs, param_specs
from twinkle_fn.data import pack
from twinkle_fn.distributed import rank
from twinkle_fn.testing import random_features, tiny_config
from twinkle_fn.testing_dist import spawn

CFG = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}
NUM_LINEARS = 2 * 7  # 2 layers x (q, k, v, o, gate, up, down); the lm_head is left out
STEPS = 3
MESHES = {"one": {}, "fsdp2": {"fsdp": 2}, "dp2": {"dp": 2}, "tp2": {"tp": 2}}


def _model():
    model = tf.models.from_hf_config(tiny_config("qwen2"), seed=0, device="cpu")
    model.module.to(torch.float64)
    return model


def _ids():
    return torch.randint(1, 96, (2, 9), generator=torch.Generator().manual_seed(3))


@torch.no_grad()
def _logits(module):
    return module(input_ids=_ids()).logits  # [2, 9, vocab]


def _whole(p):
    return p.full_tensor() if isinstance(p, DTensor) else p.detach()


def _error(fn, *args):
    try:
        fn(*args)
    except ValueError as e:
        return str(e)
    return None


def _train(mesh_sizes, adapter_dir):
    """STEPS LoRA steps on this rank's slice of each global batch, then save the adapter."""
    mesh = tf.Mesh(**mesh_sizes)
    model = lora.add_lora(_model(), CFG)
    base = {
        n: p.detach().clone() for n, p in model.module.named_parameters() if not p.requires_grad
    }
    state = tf.init(model, tf.optim.adamw(1e-2), mesh)
    module = state.model.module
    losses, frozen_grads = [], []
    for i in range(STEPS):
        feats = random_features(8, seed=100 + i)
        mine = feats[mesh.get_slice(len(feats), rank())] if mesh.world_size > 1 else feats
        grads, _ = tf.fwd_bwd(state, pack(mine))
        frozen_grads += [n for n, p in module.named_parameters() if p.grad is not None]
        state, info = tf.step(state, grads)
        losses.append(float(info["loss"]))
    adapters = tf.unshard(state)
    base_after = {n: _whole(p) for n, p in module.named_parameters() if not p.requires_grad}
    # What each rank holds, base weights included, is what the family plan predicts.
    whole = {**base, **adapters}
    specs = param_specs(whole, model.config, mesh)
    coords = mesh.coords(rank())
    unpredicted = [
        n
        for n, p in module.named_parameters()
        if isinstance(p, DTensor)
        and not torch.equal(p.to_local(), local_specs(whole[n], specs[n], coords, mesh))
    ]
    lora.save_adapter(state, adapter_dir)
    return {
        "losses": losses,
        "adapters": adapters,
        "frozen_grads": frozen_grads,
        "base_unchanged": base_after.keys() == base.keys()
        and all(torch.equal(base_after[n], base[n]) for n in base),
        "unpredicted": unpredicted,
        "sharded": sum(isinstance(p, DTensor) for p in module.parameters()),
        "logits": _logits(module),
        "adapter_dir": adapter_dir,
        "add_again": _error(lora.add_lora, state.model, CFG),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per mesh name, each rank's `_train` result (computed once, on first use)."""
    cache = {}

    def get(name):
        if name not in cache:
            adapter_dir = str(tmp_path_factory.mktemp(name) / "adapter")
            sizes = MESHES[name]
            world = tf.Mesh(**sizes).world_size
            cache[name] = (
                [_train(sizes, adapter_dir)]
                if world == 1
                else spawn(_train, world, sizes, adapter_dir)
            )
        return cache[name]

    return get


def test_adapters_start_at_zero_and_are_all_that_trains():
    model = _model()
    before = _logits(model.module)
    config = LoraConfig(**CFG)
    model = lora.add_lora(model, config)
    module = model.module
    # lora_B = 0: the adapted layers add exactly zero.
    assert torch.equal(_logits(module), before)
    assert type(module.get_output_embeddings()) is FusedLMHead
    assert config.target_modules == "all-linear"  # the caller's config is not resolved in place
    state = tf.init(model, tf.optim.adamw(1e-2))
    names = sorted(state.params)
    assert len(names) == 2 * NUM_LINEARS
    assert all(".lora_A.default." in n or ".lora_B.default." in n for n in names)
    assert sorted(state.opt_state.mu) == sorted(state.opt_state.nu) == names
    assert {n for n, p in module.named_parameters() if p.requires_grad} == set(names)


def test_training_lowers_the_loss_and_leaves_base_weights_bit_identical(tmp_path):
    model = lora.add_lora(_model(), CFG)
    module = model.module
    base = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
    state = tf.init(model, tf.optim.adamw(1e-2))
    batch = pack(random_features(8, seed=5))
    losses = []
    for _ in range(6):
        grads, _ = tf.fwd_bwd(state, batch)
        # Frozen weights get no gradient at all: autograd never computes one.
        assert all(p.grad is None for p in module.parameters())
        state, info = tf.step(state, grads)
        losses.append(float(info["loss"]))
    assert losses[-1] < losses[0] - 0.05
    assert all(torch.equal(p, base[n]) for n, p in module.named_parameters() if n in base)
    # A second save replaces the first and leaves no temporary directory behind.
    for _ in range(2):
        lora.save_adapter(state, tmp_path / "adapter")
    assert os.listdir(tmp_path) == ["adapter"]
    assert sorted(os.listdir(tmp_path / "adapter")) == [lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS]


@pytest.mark.parametrize("name", ["fsdp2", "dp2", "tp2"])
def test_mesh_matches_one_process(name, runs):
    """float64, tolerances as in backends/fsdp_test.py: the ranks sum the same token losses in
    another order (losses ~1e-12 apart); AdamW keeps the relative parameter error near that."""
    ref = runs("one")[0]
    for result in runs(name):
        assert result["losses"] == pytest.approx(ref["losses"], rel=1e-11)
        assert result["adapters"].keys() == ref["adapters"].keys()
        for n, p in result["adapters"].items():
            torch.testing.assert_close(p, ref["adapters"][n], rtol=1e-9, atol=1e-11, msg=n)
        assert result["frozen_grads"] == []
        assert result["base_unchanged"]
        assert result["sharded"] > 0 and result["unpredicted"] == []
        assert "add adapters before tf.init/tf.shard on a mesh" in result["add_again"]


@pytest.mark.parametrize("name", ["one", "fsdp2", "tp2"])
def test_saved_adapter_loads_in_peft_with_the_trained_logits(name, runs):
    """A plain HF model with the same base weights plus the adapter file reproduces the trained
    model's logits (same float64 ops: ~1e-15 apart, asserted at 1e-10)."""
    result = runs(name)[0]
    weights = load_file(os.path.join(result["adapter_dir"], lora.ADAPTER_WEIGHTS))
    assert len(weights) == 2 * NUM_LINEARS
    assert all(k.startswith(lora.PEFT_PREFIX) and ".default." not in k for k in weights)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config("qwen2"), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base.to(torch.float64), result["adapter_dir"])
    logits = _logits(peft_model)
    torch.testing.assert_close(logits, result["logits"], rtol=0, atol=1e-10)
    with peft_model.disable_adapter():
        # The adapter was loaded, not silently skipped: without it the logits differ.
        assert (_logits(peft_model) - logits).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({**CFG, "target_modules": ["lm_head", "q_proj"]}, "matches the lm_head"),
        ({**CFG, "target_modules": ["no_such_proj"]}, "no_such_proj"),
        ({**CFG, "bias": "all"}, "bias='all'"),
        ({**CFG, "modules_to_save": ["embed_tokens"]}, "modules_to_save"),
        ({**CFG, "use_dora": True}, "use_dora"),
        ({**CFG, "init_lora_weights": "pissa"}, "rewrites the base weights"),
    ],
)
def test_unsupported_configs_are_named(config, match):
    model = _model()
    with pytest.raises(ValueError, match=match):
        lora.add_lora(model, config)
    assert not any(".lora_" in n for n, _ in model.module.named_parameters())


def test_misuse_raises():
    with pytest.raises(TypeError, match="LoraConfig fields"):
        lora.add_lora(_model(), {"rank": 4})
    with pytest.raises(TypeError, match="a LoraConfig or a dict"):
        lora.add_lora(_model(), 4)
    model = lora.add_lora(_model(), CFG)
    with pytest.raises(ValueError, match="already has adapter 'default'"):
        lora.add_lora(model, CFG)
    plain = tf.init(_model(), tf.optim.adamw(1e-2))
    with pytest.raises(ValueError, match="no LoRA adapter"):
        lora.adapter_state_dict(plain)


# Frozen weight matrices of the tiny qwen2 (vocab 96, hidden 32, kv 16, intermediate 64, 2
# layers, untied): embedding and lm_head 2 x 96 x 32, per layer q, o 32 x 32, k, v 16 x 32,
# gate, up, down 64 x 32.
FROZEN_MATRIX_ELEMENTS = 2 * 96 * 32 + 2 * (2 * 32 * 32 + 2 * 16 * 32 + 3 * 64 * 32)


def _bf16_lora_state(store_frozen: bool, monkeypatch, seed: int = 0):
    """A one-process bf16 LoRA state, its frozen matrices stored in bf16 or (as before this
    option) left float32, and the module's parameter bytes before `tf.init`."""
    import twinkle_fn.backends.transformers.lora as tlora

    with monkeypatch.context() as m:
        if not store_frozen:
            m.setattr(tlora, "store_frozen_in", lambda *args: None)
        model = tf.models.from_hf_config(
            tiny_config("qwen2"), seed=seed, precision="bf16", device="cpu"
        )
        torch.manual_seed(1)
        model = lora.add_lora(model, CFG)
        before = _param_bytes(model.module)
        state = tf.init(model, tf.optim.adamw(1e-2))
    return state, before


def _param_bytes(module):
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_bf16_lora_stores_frozen_matrices_in_bf16_and_trains_float32_adapters(monkeypatch):
    state, before = _bf16_lora_state(True, monkeypatch)
    named = dict(state.model.module.named_parameters())
    frozen = {n for n, p in named.items() if not p.requires_grad}
    assert sorted(state.params) == sorted(set(named) - frozen)
    assert {state.params[n].dtype for n in state.params} == {torch.float32}
    assert {named[n].dtype for n in frozen if named[n].ndim >= 2} == {torch.bfloat16}
    assert {named[n].dtype for n in frozen if named[n].ndim < 2} == {torch.float32}
    assert sum(named[n].numel() for n in frozen if named[n].ndim >= 2) == FROZEN_MATRIX_ELEMENTS
    # Exactly two bytes saved per frozen matrix element, nothing else changed.
    assert before - _param_bytes(state.model.module) == 2 * FROZEN_MATRIX_ELEMENTS == 49152


def test_bf16_frozen_storage_leaves_the_step_and_the_reference_forward_unchanged(
    monkeypatch, tmp_path
):
    """Autocast rounds a float32 weight to bf16 as ``Tensor.to`` does, so storing the frozen
    matrices in bf16 changes no forward or backward value: the adapters after two steps and
    the adapters-off log-probs are bit-identical to the float32-stored base's."""
    batches = [pack(random_features(6, seed=40 + i)) for i in range(2)]
    runs = {}
    for store in (False, True):
        state, _ = _bf16_lora_state(store, monkeypatch)
        q_proj = state.model.module.model.layers[0].self_attn.q_proj.base_layer.weight
        assert q_proj.dtype == (torch.bfloat16 if store else torch.float32)
        for batch in batches:
            grads, _ = tf.fwd_bwd(state, batch)
            state, _ = tf.step(state, grads)
        ref = tf.token_logps(state, batches[0], disable_lora=True)["logps"]
        runs[store] = ({n: p.detach().clone() for n, p in state.params.items()}, ref, state)
    (old, old_ref, _), (new, new_ref, state) = runs[False], runs[True]
    assert old.keys() == new.keys()
    for n in old:
        torch.testing.assert_close(new[n], old[n], rtol=0, atol=0, msg=n)
    torch.testing.assert_close(new_ref, old_ref, rtol=0, atol=0)
    # The HF files keep float32 (upcast exactly) and load back into a bf16-stored state.
    tf.checkpoint.save(state, tmp_path / "ckpt")
    saved = {}
    for f in (tmp_path / "ckpt").glob("*.safetensors"):
        saved.update(load_file(f))
    assert {t.dtype for t in saved.values()} == {torch.float32}
    base = dict(state.model.module.named_parameters())
    for n, t in saved.items():
        assert torch.equal(t, base[n].detach().float()), n
    fresh, _ = _bf16_lora_state(True, monkeypatch, seed=1)
    loaded = tf.checkpoint.load(fresh, tmp_path / "ckpt")
    for n, p in loaded.model.module.named_parameters():
        assert p.dtype == base[n].dtype and torch.equal(p.detach(), base[n].detach()), n
