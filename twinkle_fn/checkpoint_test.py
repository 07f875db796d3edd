import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import twinkle_fn as tf
from twinkle_fn.data import pack
from twinkle_fn.testing import random_features, tiny_config


def _state(seed=0, tied=False):
    model = tf.models.from_hf_config(
        tiny_config("qwen2", tie_word_embeddings=tied), seed=seed, device="cpu"
    )
    tx = tf.optim.chain(tf.optim.clip_by_global_norm(1.0), tf.optim.adamw(1e-2))
    return tf.init(model, tx, seed=5)


def _train(state, batch, n):
    for _ in range(n):
        state, _ = tf.step(state, tf.fwd_bwd(state, batch)[0])
    return state


@pytest.mark.parametrize("tied", [False, True])
def test_save_load_step_equals_step(tmp_path, tied):
    batch = pack(random_features(4))
    state = _train(_state(tied=tied), batch, 2)
    tf.checkpoint.save(state, tmp_path / "ckpt", extra={"data_position": 8})
    expected, _ = tf.step(state, tf.fwd_bwd(state, batch)[0], donate=False)

    fresh = _state(seed=1, tied=tied)
    loaded = tf.checkpoint.load(fresh, tmp_path / "ckpt")
    assert int(loaded.step) == 2 and torch.equal(loaded.rng, state.rng)
    got, _ = tf.step(loaded, tf.fwd_bwd(loaded, batch)[0])
    for name in expected.params:
        assert torch.equal(got.params[name], expected.params[name]), name
    assert tf.checkpoint.read_extra(tmp_path / "ckpt") == {"data_position": 8}


def test_checkpoint_loads_in_transformers(tmp_path):
    state = _state()
    tf.checkpoint.save(state, tmp_path / "ckpt")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    ids = torch.randint(1, 96, (2, 7))
    torch.testing.assert_close(hf(input_ids=ids).logits, state.model.module(input_ids=ids).logits)


def test_interrupted_save_leaves_nothing_loadable(tmp_path, monkeypatch):
    state = _state()
    tf.checkpoint.save(state, tmp_path / "ckpt")
    first = json.loads((tmp_path / "ckpt" / tf.checkpoint.MANIFEST).read_text())

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tf.checkpoint, "_write_json", crash)
    with pytest.raises(KeyboardInterrupt):
        tf.checkpoint.save(state, tmp_path / "ckpt")
    with pytest.raises(KeyboardInterrupt):
        tf.checkpoint.save(state, tmp_path / "other")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert json.loads((tmp_path / "ckpt" / tf.checkpoint.MANIFEST).read_text()) == first
    assert not tf.checkpoint.is_complete(tmp_path / "other")


def test_load_rejects_incomplete_and_mismatched_checkpoints(tmp_path):
    state = _state()
    tf.checkpoint.save(state, tmp_path / "ckpt")
    (tmp_path / "ckpt" / tf.checkpoint.MANIFEST).unlink()
    with pytest.raises(ValueError, match="not a complete twinkle checkpoint"):
        tf.checkpoint.load(_state(), tmp_path / "ckpt")

    tf.checkpoint.save(state, tmp_path / "ckpt2")
    other = tf.init(state.model, tf.optim.sgd(0.1, momentum=0.9))
    with pytest.raises(ValueError, match="another optimizer"):
        tf.checkpoint.load(other, tmp_path / "ckpt2", donate=False)


def test_load_without_donation_keeps_the_template(tmp_path):
    state = _state()
    tf.checkpoint.save(state, tmp_path / "ckpt")
    template = _state(seed=3)
    before = {n: p.clone() for n, p in template.params.items()}
    loaded = tf.checkpoint.load(template, tmp_path / "ckpt", donate=False)
    assert not template.donated
    for n in before:
        assert torch.equal(template.params[n], before[n])
        assert torch.equal(loaded.params[n], state.params[n])


def _dist_state(mesh):
    model = tf.models.from_hf_config(tiny_config("qwen2"), seed=0, device="cpu")
    model.module.to(torch.float64)
    tx = tf.optim.chain(tf.optim.clip_by_global_norm(1.0), tf.optim.adamw(1e-2))
    return tf.init(model, tx, mesh)


def _dist_step(state, seed):
    from twinkle_fn.distributed import rank

    feats = random_features(8, seed=seed)
    mine = feats[state.mesh.get_slice(8, rank())] if state.mesh.world_size > 1 else feats
    return tf.step(state, tf.fwd_bwd(state, pack(mine))[0])[0]


def _save_on_fsdp2_resume_on_tp2(ckpt):
    state = _dist_state(tf.Mesh(fsdp=2))
    state = _dist_step(_dist_step(state, 1), 2)
    saved_params = tf.unshard(state)
    tf.checkpoint.save(state, ckpt, extra={"consumed": 16})
    straight = tf.unshard(_dist_step(state, 3))
    resumed = tf.checkpoint.load(_dist_state(tf.Mesh(tp=2)), ckpt)
    assert int(resumed.step) == 2
    return saved_params, straight, tf.unshard(_dist_step(resumed, 3))


def test_sharded_checkpoint_resumes_on_another_mesh_and_exports_hf(tmp_path):
    """Saved on fsdp2, resumed on tp2 and on one process: the next step equals the uninterrupted
    one (float64; different meshes sum in different orders, hence 1e-9 rather than exact)."""
    from twinkle_fn.testing_dist import spawn

    ckpt = tmp_path / "ckpt"
    (saved, straight, resumed), _ = spawn(_save_on_fsdp2_resume_on_tp2, 2, ckpt)
    for n in straight:
        torch.testing.assert_close(resumed[n], straight[n], rtol=1e-9, atol=1e-12, msg=n)
    one = _dist_step(tf.checkpoint.load(_dist_state(tf.Mesh()), ckpt), 3)
    for n in straight:
        torch.testing.assert_close(one.params[n].detach(), straight[n], rtol=1e-9, atol=1e-12)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64)
    for n, p in hf.named_parameters():
        assert torch.equal(p.detach(), saved[n]), n
    assert tf.checkpoint.read_extra(ckpt) == {"consumed": 16}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
