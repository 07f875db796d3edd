"""Expert parallelism on the transformers backend: qwen3_moe on two real gloo ranks (ep2 with dp2
and with fsdp2) trains like one process, its shards are what the specs predict, and its
checkpoint and weight export are one process's; qwen2_moe and mixtral train like one process on
fsdp2xep2 too, and so does LoRA on qwen3_moe's experts (its adapter loads in peft); meshes and
families it does not run are refused before compute."""

import sys

import pytest
import torch
import transformers
from peft import PeftModel

import twinkle_fn as tf
from twinkle_fn.backends.transformers.expert_parallel import check_expert_parallel, expert_spec
from twinkle_fn.backends.transformers.plans import local_specs, param_specs
from twinkle_fn.backends.transformers.sharding import shard_params, unshard_params
from twinkle_fn.data import pack, pad_collate
from twinkle_fn.distributed import rank
from twinkle_fn.export_test import hf_logps
from twinkle_fn.sharding import ShardSpec
from twinkle_fn.testing import random_features, tiny_config
from twinkle_fn.testing_dist import spawn

STEPS = 2
MESHES = {"dp2xep2": {"dp": 2, "ep": 2}, "fsdp2xep2": {"fsdp": 2, "ep": 2}}
PARAM_ATOL = 2e-5
# Expert LoRA factors: an expert's rows see a token or two, so some gradients sit near Adam's
# eps (1e-8), where rounding moves the update most (observed 2.4e-5 on a lora_B element).
LORA_PARAM_ATOL = 1e-4
# The same code on the other MoE families' layouts: a shared expert (qwen2_moe), Mixtral's.
OTHER_FAMILIES = ("qwen2_moe", "mixtral")
GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"
LORA = {"r": 2, "lora_alpha": 4, "target_modules": "all-linear", "init_lora_weights": False}


def _state(mesh, family="qwen3_moe"):
    model = tf.models.from_hf_config(tiny_config(family), seed=0, device="cpu")
    full = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    tx = tf.optim.chain(tf.optim.clip_by_global_norm(1.0), tf.optim.adamw(1e-2))
    return tf.init(model, tx, mesh), full


def _lora_state(mesh, family="qwen3_moe"):
    """`family` with upstream's EP cookbook adapter: ``all-linear`` (attention and both fused
    expert tensors, peft's ``ParamWrapper``), random B so the experts' update is nonzero."""
    model = tf.models.from_hf_config(tiny_config(family), seed=0, device="cpu")
    torch.manual_seed(1)
    model = tf.lora.add_lora(model, LORA)
    tx = tf.optim.chain(tf.optim.clip_by_global_norm(1.0), tf.optim.adamw(1e-2))
    return tf.init(model, tx, mesh), None


def _train(mesh, family="qwen3_moe", make_state=_state):
    """STEPS AdamW steps, each rank on its slice of each global batch; the losses and the state."""
    state, full = make_state(mesh, family)
    losses = []
    for i in range(STEPS):
        feats = random_features(8, seed=100 + i)
        mine = feats[mesh.get_slice(len(feats), rank())] if mesh.world_size > 1 else feats
        grads, _ = tf.fwd_bwd(state, pack(mine))
        state, info = tf.step(state, grads)
        losses.append(float(info["loss"]))
    return losses, state, full


def _exported(state):
    stream = tf.export_weights(state, dtype=torch.float32, bucket_bytes=16 << 10)
    return [kv for bucket in stream for kv in bucket]


def _on_two_ranks(checkpoint_dir, adapter_dir):
    """Every case on one spawn: per mesh the losses, the unsharded parameters, the parameters
    whose initial local shard differs from `shard_params`' prediction, and the export; the dp2xep2
    state saved to `checkpoint_dir`; expert LoRA trained on fsdp2xep2, its adapter saved to
    `adapter_dir`."""
    out = {}
    for name, sizes in MESHES.items():
        mesh = tf.Mesh(**sizes)
        state, full = _state(mesh)
        coords = {**mesh.coords(rank()), **mesh.expert_coords(rank())}
        specs = param_specs(full, state.model.config, mesh)
        mismatched = [
            n
            for n, p in state.params.items()
            if not torch.equal(p.to_local(), local_specs(full[n], specs[n], coords, mesh))
        ]
        losses, state, _ = _train(mesh)
        out[name] = {
            "losses": losses,
            "params": tf.unshard(state),
            "mismatched": mismatched,
            "local_experts": state.model.module.model.layers[0].mlp.experts.num_experts,
            "export": _exported(state),
        }
        if name == "dp2xep2":
            tf.checkpoint.save(state, checkpoint_dir)
    for family in OTHER_FAMILIES:
        losses, state, _ = _train(tf.Mesh(fsdp=2, ep=2), family)
        out[family] = {"losses": losses, "params": tf.unshard(state)}
    dense = tf.models.from_hf_config(tiny_config("qwen2"), seed=0, device="cpu")
    try:
        tf.init(dense, tf.optim.adamw(1e-2), tf.Mesh(dp=2, ep=2))
    except ValueError as e:
        out["dense_refusal"] = str(e)
    # peft's "all-linear" adapts the fused experts too: their factors stay whole on each rank
    losses, state, _ = _train(tf.Mesh(fsdp=2, ep=2), make_state=_lora_state)
    tf.lora.save_adapter(state, adapter_dir)
    out["lora"] = {"losses": losses, "params": tf.unshard(state)}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    checkpoint_dir = tmp_path_factory.mktemp("ep") / "ckpt"
    adapter_dir = checkpoint_dir.parent / "adapter"
    losses, state, _ = _train(tf.Mesh())
    reference = {"losses": losses, "params": tf.unshard(state), "export": _exported(state)}
    for family in OTHER_FAMILIES:
        losses, state, _ = _train(tf.Mesh(), family)
        reference[family] = {"losses": losses, "params": tf.unshard(state)}
    losses, state, _ = _train(tf.Mesh(), make_state=_lora_state)
    reference["lora"] = {"losses": losses, "params": tf.unshard(state)}
    reference["lora_logps"] = tf.token_logps(state, pad_collate(random_features(4, seed=7), 0))
    two = spawn(_on_two_ranks, 2, str(checkpoint_dir), str(adapter_dir), timeout_s=300)
    return reference, two, checkpoint_dir


@pytest.mark.parametrize("name", [*MESHES, *OTHER_FAMILIES, "lora"])
def test_ep_trains_like_one_process(name, runs):
    """float32 (transformers' grouped-GEMM experts have no float64 kernel on CPU): the ranks
    run each (token, expert) row through the same expert as one process, but apply the routing
    weights after the all-to-all and sum token losses in another order, so values differ in
    their last bits: losses to 1e-6 relative; parameters after 2 AdamW steps to `PARAM_ATOL`
    absolute (Adam's first steps move an element by ~lr = 1e-2 whatever its gradient's size,
    so a near-zero gradient that differs by rounding moves it by up to a few 1e-6; expert LoRA
    to `LORA_PARAM_ATOL`)."""
    reference, two, _ = runs
    ref = reference.get(name, reference)
    atol = LORA_PARAM_ATOL if name == "lora" else PARAM_ATOL
    for out in (r[name] for r in two):
        assert out["losses"] == pytest.approx(ref["losses"], rel=1e-6)
        assert out["params"].keys() == ref["params"].keys()
        worst = {n: (p - ref["params"][n]).abs().max().item() for n, p in out["params"].items()}
        assert max(worst.values()) <= atol, max(worst, key=worst.get)
        if name in MESHES:
            assert out["mismatched"] == []
            assert out["local_experts"] == 2  # 4 experts over ep=2


def test_tf_init_refuses_ep_for_a_dense_family(runs):
    _, two, _ = runs
    assert all("a qwen2 model has none" in r.get("dense_refusal", "") for r in two)


def test_expert_lora_under_ep_trains_the_experts_and_saves_a_peft_adapter(runs):
    """``lora`` above: the expert factors (peft's ParamWrapper, whole on each ep rank) train
    like one process's; here, they moved, and the adapter saved from the two ranks loads in
    peft onto the HF model with one process's log-probabilities (float32: 1e-5 absolute, the
    parameters' agreement carried through two layers)."""
    reference, two, checkpoint_dir = runs
    params = two[0]["lora"]["params"]
    experts = [n for n in params if ".mlp.experts." in n and ".lora_" in n]
    assert len(experts) == 8  # A and B of gate_up_proj and down_proj, two layers
    model = tf.lora.add_lora(
        tf.models.from_hf_config(tiny_config("qwen3_moe"), seed=0, device="cpu"), LORA
    )
    initial = dict(model.module.named_parameters())
    assert all(not torch.equal(params[n], initial[n]) for n in experts)
    hf = tf.models.from_hf_config(tiny_config("qwen3_moe"), seed=0, device="cpu").module
    peft_model = PeftModel.from_pretrained(hf, checkpoint_dir.parent / "adapter").eval()
    got = hf_logps(peft_model, pad_collate(random_features(4, seed=7), 0))
    torch.testing.assert_close(got, reference["lora_logps"]["logps"], rtol=0, atol=1e-5)


def test_ep_checkpoint_loads_on_one_process(runs):
    _, two, checkpoint_dir = runs
    state, _ = _state(tf.Mesh())
    loaded = tf.unshard(tf.checkpoint.load(state, checkpoint_dir))
    saved = two[0]["dp2xep2"]["params"]
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[n], saved[n]) for n in saved)


@pytest.mark.parametrize("name", list(MESHES))
def test_ep_export_has_per_expert_checkpoint_names(name, runs):
    """The stream names each expert's linears as the HF checkpoint does, with one process's
    values (float32, to `PARAM_ATOL` as the parameters they are)."""
    reference, two, _ = runs
    mine = dict(two[0][name]["export"])
    theirs = dict(reference["export"])
    assert len(mine) == len(two[0][name]["export"])  # each name once
    assert sorted(mine) == sorted(theirs)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in mine
    assert not any(n.endswith("experts.gate_up_proj") for n in mine)
    for n, t in mine.items():
        torch.testing.assert_close(t, theirs[n], rtol=0, atol=PARAM_ATOL, msg=n)


def test_expert_specs_split_experts_over_ep_then_edp_and_invert():
    config = tiny_config("qwen3_moe")
    mesh = tf.Mesh(dp=4, ep=2)  # edp = 2
    model = tf.models.from_hf_config(config, seed=0, device="cpu")
    full = {n: p.detach() for n, p in model.module.named_parameters()}
    assert param_specs([GATE_UP], config, mesh)[GATE_UP] == (
        ShardSpec(0, "ep"),
        ShardSpec(0, "edp"),
    )
    assert expert_spec("model.layers.0.mlp.gate.weight", config) is None  # the router is dense
    # rank 3: ep=1 (experts 2, 3), edp=1 (the second of those)
    assert torch.equal(shard_params(full, mesh, config, 3)[GATE_UP], full[GATE_UP][3:4])
    pieces = {r: shard_params(full, mesh, config, r) for r in range(mesh.world_size)}
    back = unshard_params(pieces, mesh, config)
    assert all(torch.equal(back[n], full[n]) for n in full)


@pytest.mark.parametrize(
    ("family", "overrides", "sizes", "match"),
    [
        ("qwen2", {}, {"dp": 2, "ep": 2}, "a qwen2 model has none"),
        ("qwen3_moe", {"num_experts": 3}, {"dp": 2, "ep": 2}, "ep=2 does not divide the 3 experts"),
        ("qwen3_moe", {}, {"dp": 2, "tp": 2, "ep": 2}, "ep=2 with tp=2 is not supported"),
        ("qwen3_moe", {}, {"dp": 4, "ep": 2, "etp": 2}, "ep=2 with etp=2 is not supported"),
    ],
)
def test_unsupported_expert_parallelism_is_refused(family, overrides, sizes, match):
    config = tiny_config(family, **overrides)
    with pytest.raises(ValueError, match=match):
        check_expert_parallel(config, tf.Mesh(**sizes))
    with pytest.raises(ValueError, match=match):
        shard_params({}, tf.Mesh(**sizes), config, 0)


def test_a_family_without_a_transformers_ep_plan_is_refused():
    config = tiny_config("qwen3_moe")
    config.base_model_ep_plan = None
    with pytest.raises(ValueError, match="qwen3_moe's config has"):
        check_expert_parallel(config, tf.Mesh(dp=2, ep=2))


def test_ep_on_a_transformers_without_its_expert_parallelism_is_refused(monkeypatch):
    """A transformers that predates ``transformers.distributed.expert_parallel`` (the GPU
    machines' 5.17) still runs the backend; an ep mesh is refused naming the version, and an
    ep=1 mesh never imports it."""
    monkeypatch.setitem(sys.modules, "transformers.distributed.expert_parallel", None)
    config = tiny_config("qwen3_moe")
    check_expert_parallel(config, tf.Mesh(dp=2))
    with pytest.raises(ValueError, match=rf"transformers {transformers.__version__} lacks"):
        check_expert_parallel(config, tf.Mesh(dp=2, ep=2))
