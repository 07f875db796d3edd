"""A critic on the megatron backend (``head="value"``: ``GPTModel`` ending in a ``ValueHead``).

One process (in this process, megatron on one gloo rank): the per-token values equal the
transformers backend's critic and transformers' own ``AutoModelForTokenClassification`` built
from the same seed, padded and packed; value-loss steps equal the transformers backend's;
``from_pretrained`` builds the same critic as the transformers backend from a causal LM's
checkpoint (same seed: same head) and from a critic's; and the refusals come before any compute.
Two ranks (one spawn): value-loss steps on tp2, tp2 with sequence parallelism, pp2 (tied
embeddings, which a critic never ties), dp2 and cp2, padded and packed, equal one process; a
checkpoint saved on tp2 loads back bit-exactly and its HF files, like ``tf.export_weights``,
load into ``AutoModelForTokenClassification`` with the trainer's values.

Tolerances (float32: megatron's distributed optimizer has no float64 path), as `backend_test`
states them: values of the same weights 1e-5 absolute (float32 sums of 32 products in another
order; observed <= 1e-7), losses 1e-5 relative, parameters after 2 AdamW steps at lr 1e-2
2e-4 absolute (Adam moves an element whose gradient is float32 noise by up to lr).
"""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

import twinkle_fn as tf
from twinkle_fn.backends.megatron import parallel
from twinkle_fn.backends.megatron import train as train_module
from twinkle_fn.backends.megatron.backend import megatron_optimizer
from twinkle_fn.backends.megatron.model import ValueHead
from twinkle_fn.backends.megatron.placement import model_placement
from twinkle_fn.data import pack, pad_collate
from twinkle_fn.distributed import rank
from twinkle_fn.testing import random_features, tiny_config, with_value_fields
from twinkle_fn.testing_dist import spawn

LOSS = tf.losses.value_loss(0.2)
CLIP = 0.5
STEPS = 2
VALUES_ATOL, LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-5, 2e-4
# name -> (tie_word_embeddings, mesh sizes, backend options, batch layout)
MESHES = {
    "tp2": (False, {"tp": 2}, {}, "padded"),
    "tp2-sp": (False, {"tp": 2, "sequence_parallel": True}, {}, "packed"),
    "pp2": (True, {"pp": 2}, {"num_micro_batches": 2}, "padded"),
    "dp2": (False, {"dp": 2}, {}, "packed"),
    "cp2": (False, {"cp": 2}, {}, "packed"),
}


def _config(tied=False):
    return tiny_config("qwen2", tie_word_embeddings=tied)


def _critic(backend, tied=False, seed=0, options=None):
    return tf.models.from_hf_config(
        _config(tied), seed=seed, head="value", backend=backend, options=options
    )


def _tx(backend):
    """AdamW clipped to global norm `CLIP`, which binds (gradient norms here are ~1):
    a replicated head counted once per tp group, or twice, shows in every update."""
    if backend == "megatron":
        return megatron_optimizer(1e-2, clip_grad=CLIP, weight_decay=0.01)
    return tf.optim.chain(
        tf.optim.clip_by_global_norm(CLIP), tf.optim.adamw(1e-2, weight_decay=0.01)
    )


def _batch(feats, layout):
    return pack(feats) if layout == "packed" else pad_collate(feats, pad_token_id=0)


def _feats(step):
    return with_value_fields(random_features(8, seed=200 + step), seed=step)


def _train(backend="megatron", tied=False, sizes=None, options=None, layout="packed"):
    """STEPS value-loss steps on this rank's slice of each batch of 8: the values of the whole
    first batch before training, the losses and gradient norms, the values `fwd_bwd` saw on
    this rank's first slice, and the final parameters (HF names); and the state."""
    mesh = tf.Mesh(**(sizes or {}))
    state = tf.init(_critic(backend, tied, options=options), _tx(backend), mesh)
    values = tf.token_values(state, _batch(_feats(0), layout))["values"]
    losses, norms, seen = [], [], None
    for i in range(STEPS):
        feats = _feats(i)
        grads, aux = tf.fwd_bwd(state, _batch(feats[mesh.get_slice(8, rank())], layout), loss=LOSS)
        seen = aux.get("values") if seen is None else seen
        state, info = tf.step(state, grads)
        losses.append(float(info["loss"]))
        norms.append(float(info["grad_norm"]))
    run = dict(values=values, losses=losses, norms=norms, seen=seen, params=tf.unshard(state))
    return run, state


def _hf_critic(tied=False, seed=0):
    """transformers' own critic of the family from `seed`, as the backends build it."""
    config = copy.deepcopy(_config(tied))
    config.update({"num_labels": 1, "classifier_dropout": 0.0})
    torch.manual_seed(seed)
    return AutoModelForTokenClassification.from_config(config).eval()


def _hf_values(module, feats):
    """``[B, T]`` values of a plain forward of `module` on the right-padded `feats`."""
    padded = pad_collate(feats, pad_token_id=0)
    with torch.no_grad():
        scores = module(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"])
    return torch.where(padded["labels"] != -100, scores.logits[..., 0], 0.0)


def _from_pretrained(directory, backend, seed):
    torch.manual_seed(seed)
    model = tf.models.from_pretrained(directory, head="value", backend=backend)
    return tf.unshard(tf.init(model, _tx(backend)))


@pytest.fixture(scope="module")
def one(megatron_world, tmp_path_factory):
    root = tmp_path_factory.mktemp("critic")
    runs = {
        (backend, tied, layout): _train(backend, tied, layout=layout)[0]
        for backend, tied, layout in (
            ("transformers", False, "packed"),
            ("megatron", False, "packed"),
            ("megatron", False, "padded"),
            ("megatron", True, "padded"),
        )
    }
    feats = random_features(4, seed=3)
    states = {b: tf.init(_critic(b), _tx(b)) for b in ("transformers", "megatron")}
    values = {
        (b, layout): tf.token_values(state, _batch(feats, layout))["values"]
        for b, state in states.items()
        for layout in ("padded", "packed")
    }
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config()).save_pretrained(root / "lm")
    states["transformers"].model.module.save_pretrained(root / "critic")
    loaded = {
        (kind, b): _from_pretrained(root / kind, b, seed=7)
        for kind in ("lm", "critic")
        for b in ("transformers", "megatron")
    }
    head = model_placement(states["megatron"].model).module.output_layer
    bf16 = tf.init(
        tf.models.from_hf_config(
            _config(), seed=0, head="value", backend="megatron", precision="bf16"
        ),
        _tx("megatron"),
    )
    values["bf16"] = tf.token_values(bf16, _batch(feats, "padded"))["values"]
    return dict(runs=runs, feats=feats, values=values, loaded=loaded, states=states, head=head)


def test_values_equal_the_transformers_critic_and_hfs_token_classification_model(one):
    feats = one["feats"]
    want = _hf_values(_hf_critic(), feats)  # [B, T]
    assert isinstance(one["head"], ValueHead) and one["head"].weight.shape == (1, 32)
    got = one["values"]["megatron", "padded"]
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=VALUES_ATOL)
    torch.testing.assert_close(got, one["values"]["transformers", "padded"], rtol=0, atol=1e-5)
    packed = one["values"]["megatron", "packed"]  # [1, T]
    assert packed.shape[0] == 1
    torch.testing.assert_close(packed[packed != 0], want[want != 0], rtol=0, atol=VALUES_ATOL)
    assert bool((got[pad_collate(feats, pad_token_id=0)["labels"] == -100] == 0).all())
    # bf16 (megatron's Float16Module around the head): bf16 rounding of values ~0.2 (observed 1e-3)
    assert one["values"]["bf16"].dtype == torch.float32
    torch.testing.assert_close(one["values"]["bf16"], got, rtol=0, atol=1e-2)


def test_value_loss_steps_equal_the_transformers_backends(one):
    got, want = (
        one["runs"]["megatron", False, "packed"],
        one["runs"]["transformers", False, "packed"],
    )
    torch.testing.assert_close(got["losses"], want["losses"], rtol=LOSS_RTOL, atol=0)
    torch.testing.assert_close(got["norms"], want["norms"], rtol=LOSS_RTOL, atol=0)
    assert min(got["norms"]) > CLIP  # the clip binds
    torch.testing.assert_close(got["values"], want["values"], rtol=0, atol=VALUES_ATOL)
    # fwd_bwd's aux: the values the first step trained on (the whole batch here), before its update
    torch.testing.assert_close(got["seen"], got["values"], rtol=0, atol=VALUES_ATOL)
    assert got["params"].keys() == want["params"].keys()
    assert {"score.weight", "score.bias"} <= got["params"].keys()
    assert "lm_head.weight" not in got["params"]
    for name, p in want["params"].items():
        torch.testing.assert_close(got["params"][name], p, rtol=0, atol=PARAM_ATOL, msg=name)
    # the head trained: it moved from its initial weights
    initial = _hf_critic().score.weight.detach()
    assert not torch.allclose(got["params"]["score.weight"], initial, atol=1e-3)


def test_from_pretrained_builds_the_transformers_backends_critic(one):
    """From a causal LM's files (lm_head ignored, the head initialised from the same seed) and
    from a critic's (``score`` read): bit-identical weights on both backends."""
    for kind in ("lm", "critic"):
        want = one["loaded"][kind, "transformers"]
        got = one["loaded"][kind, "megatron"]
        assert got.keys() == want.keys(), kind
        for name, p in want.items():
            assert torch.equal(got[name], p), (kind, name)
    lm_body = one["loaded"]["lm", "megatron"]
    critic = one["loaded"]["critic", "megatron"]
    assert torch.equal(lm_body["model.embed_tokens.weight"], critic["model.embed_tokens.weight"])
    assert not torch.equal(lm_body["score.weight"], critic["score.weight"])  # seed 7, not 0


def test_what_a_critic_cannot_feed_is_refused_before_any_compute(one, monkeypatch):
    """The schedule never runs; a LoRA critic is refused before megatron builds it."""
    critic = one["states"]["megatron"]
    actor = tf.init(
        tf.models.from_hf_config(_config(), seed=0, backend="megatron"), _tx("megatron")
    )
    feats = with_value_fields(random_features(3, seed=4), seed=4)

    def no_compute(*args, **kwargs):
        raise AssertionError("the backend computed")

    monkeypatch.setattr(train_module, "get_forward_backward_func", no_compute)
    for state, loss, match in (
        (critic, None, "value head.*the default cross entropy cannot train it"),
        (critic, tf.losses.policy_gradient(), r"value head.*PolicyGradient\(.*cannot train it"),
        (actor, LOSS, "ValueLoss.*needs 'values'.*no value head.*head='value'"),
    ):
        with pytest.raises(ValueError, match=match):
            tf.fwd_bwd(state, pack(feats), loss=loss)
    with pytest.raises(ValueError, match=r"value model \(head='value'\).*tf.token_values"):
        tf.token_logps(critic, pack(feats))
    with pytest.raises(ValueError, match="default cross entropy cannot train it"):
        tf.evaluate(critic, pack(feats))
    with pytest.raises(ValueError, match=r"tf.token_values needs a value model.*head='value'"):
        tf.token_values(actor, pack(feats))
    lora = _critic("megatron", options={"lora": {"r": 4, "target_modules": "all-linear"}})
    with pytest.raises(ValueError, match="LoRA on a value model would freeze"):
        tf.init(lora, _tx("megatron"))


def _two_ranks(root):
    runs = {}
    for name, (tied, sizes, options, layout) in MESHES.items():
        runs[name] = _train("megatron", tied, sizes, options, layout)[0]
        parallel.destroy()
    # save on tp2, load into a critic of other weights on tp2: bit-exact; export its weights
    mesh = tf.Mesh(tp=2)
    saved, state = _train("megatron", sizes={"tp": 2}, layout="padded")
    tf.checkpoint.save(state, root / "ckpt")
    exported = {
        n: t.clone()
        for bucket in tf.export_weights(state, dtype=torch.float32, bucket_bytes=4096)
        for n, t in bucket
    }
    other = tf.init(_critic("megatron", seed=1), _tx("megatron"), mesh)
    other = tf.checkpoint.load(other, root / "ckpt")
    batch = pad_collate(_feats(5), pad_token_id=0)
    saved_values = tf.token_values(state, batch)["values"]
    loaded_values = tf.token_values(other, batch)["values"]
    steps = []
    for s in (state, other):  # one more step from each: same optimizer state, same result
        grads, _ = tf.fwd_bwd(s, batch, loss=LOSS)
        steps.append(tf.unshard(tf.step(s, grads)[0]))
    parallel.destroy()
    return dict(
        runs=runs,
        saved=saved["params"],
        loaded=steps[1],
        stepped=steps[0],
        exported=exported,
        values=(saved_values, loaded_values),
    )


@pytest.fixture(scope="module")
def two(one, tmp_path_factory):
    root = tmp_path_factory.mktemp("critic2")
    return root, spawn(_two_ranks, 2, root, timeout_s=300)


@pytest.mark.parametrize("mesh", MESHES)
def test_value_loss_steps_on_a_mesh_equal_one_process(one, two, mesh):
    tied, _, _, layout = MESHES[mesh]
    want = one["runs"]["megatron", tied, layout]
    for got in (r["runs"][mesh] for r in two[1]):
        torch.testing.assert_close(got["losses"], want["losses"], rtol=LOSS_RTOL, atol=0)
        torch.testing.assert_close(got["norms"], want["norms"], rtol=LOSS_RTOL, atol=0)
        torch.testing.assert_close(got["values"], want["values"], rtol=0, atol=VALUES_ATOL)
        assert got["params"].keys() == want["params"].keys()
        for name, p in want["params"].items():
            torch.testing.assert_close(got["params"][name], p, rtol=0, atol=PARAM_ATOL, msg=name)


def test_a_checkpoint_loads_back_bit_exactly_and_its_hf_files_are_a_critic(one, two):
    root, ranks = two
    for r in ranks:
        assert torch.equal(*r["values"])
        assert r["stepped"].keys() == r["loaded"].keys()
        for name, p in r["stepped"].items():
            assert torch.equal(r["loaded"][name], p), name
    run = ranks[0]
    hf = AutoModelForTokenClassification.from_pretrained(root / "ckpt").eval()
    assert type(hf).__name__ == "Qwen2ForTokenClassification"
    for name, p in hf.state_dict().items():
        assert torch.equal(p, run["saved"][name]), name
    feats = _feats(5)
    torch.testing.assert_close(_hf_values(hf, feats), run["values"][0], rtol=0, atol=VALUES_ATOL)
    # the exported stream: the same tensors, under the token-classification model's names
    assert run["exported"].keys() == hf.state_dict().keys()
    for name, p in hf.state_dict().items():
        assert torch.equal(run["exported"][name], p), name
