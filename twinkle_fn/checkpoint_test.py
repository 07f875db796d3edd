"""`tf.checkpoint` save and load: a resumed state steps exactly as one that never saved, on one
process and from fsdp2 onto tp2, the files load in transformers, interrupted or non-finite saves
leave the previous checkpoint, and a sharded load is refused on every rank before it writes. A
save killed at any file-system call is ``checkpoint_kill_test``'s, refused damaged or foreign
checkpoints ``checkpoint_refusal_test``'s."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import twinkle_fn as tf
from twinkle_fn.data import pack
from twinkle_fn.pytree import tree_leaves
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


def _sharded_refusal(ckpt):
    """On fsdp2: save a state whose optimizer moments hold an infinity on rank 1 only (a save
    checks the parameters alone), then load it into a fresh fsdp2 state: every rank refuses,
    and the state is undonated, bit-identical and steps."""
    from twinkle_fn.distributed import rank

    state = _dist_step(_dist_state(tf.Mesh(fsdp=2)), 1)
    if rank() == 1:
        tree_leaves(state.opt_state)[-1].to_local().view(-1)[0] = float("inf")
    tf.checkpoint.save(state, ckpt)
    fresh = _dist_state(tf.Mesh(fsdp=2))
    before = [
        t.to_local().clone() if hasattr(t, "to_local") else t.clone() for t in tree_leaves(fresh)
    ]
    with pytest.raises(ValueError) as error:
        tf.checkpoint.load(fresh, ckpt)
    after = [t.to_local() if hasattr(t, "to_local") else t for t in tree_leaves(fresh)]
    same = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    donated = fresh.donated
    return str(error.value), donated, same, int(_dist_step(fresh, 2).step)


def test_a_sharded_load_is_refused_on_every_rank_before_it_writes(tmp_path):
    """The DCP part is read into scratch tensors and checked before the state is written; the
    ranks agree, so the rank that found nothing refuses too rather than write alone."""
    from twinkle_fn.testing_dist import spawn

    results = spawn(_sharded_refusal, 2, tmp_path / "ckpt")
    messages = [r[0] for r in results]
    assert "dcp" in messages[1] and "holds NaN or infinity" in messages[1], messages[1]
    assert "another rank found a tensor holding NaN or infinity" in messages[0], messages[0]
    for _, donated, same, step in results:
        assert not donated and same and step == 1


def test_save_refuses_nonfinite_parameters_and_keeps_the_good_checkpoint(tmp_path):
    good = _state()
    tf.checkpoint.save(good, tmp_path / "ckpt")
    bad = _state()
    with torch.no_grad():
        next(iter(bad.params.values())).view(-1)[3] = float("inf")
    with pytest.raises(ValueError, match=r"step 0 .*NaN or infinity.*allow_nonfinite=True"):
        tf.checkpoint.save(bad, tmp_path / "ckpt")
    loaded = tf.checkpoint.load(_state(seed=2), tmp_path / "ckpt")
    for name, p in good.params.items():
        assert torch.equal(loaded.params[name], p), name
    tf.checkpoint.save(bad, tmp_path / "forced", allow_nonfinite=True)
    assert tf.checkpoint.is_complete(tmp_path / "forced")
