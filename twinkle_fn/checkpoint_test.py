import builtins
import contextlib
import json
import os
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
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


class _Killed(BaseException):
    """The process died: raised by every file-system call from the k-th on, cleanup included."""


@contextlib.contextmanager
def _killed_at(k):
    """From the `k`-th file-system call (rename, exchange, mkdir, open, rmtree, manifest) on,
    every such call raises `_Killed`, as if the process were SIGKILLed there: no later write
    and no cleanup happens. Yields the call counter (``[n]``)."""
    calls = [0]

    def hook(fn):
        def hooked(*args, **kwargs):
            calls[0] += 1
            if calls[0] >= k:
                raise _Killed
            return fn(*args, **kwargs)

        return hooked

    targets = [
        (os, "rename"),
        (os, "replace"),
        (os, "mkdir"),
        (shutil, "rmtree"),
        (builtins, "open"),
        (tf.checkpoint, "_exchange"),
        (tf.checkpoint, "_write_json"),
    ]
    with pytest.MonkeyPatch.context() as mp:
        for owner, name in targets:
            mp.setattr(owner, name, hook(getattr(owner, name)))
        yield calls


def _kill_every_point(save_new, check):
    """Run `save_new` killed at its 1st, 2nd, ... file-system call until it completes; after
    each kill call `check(killed_at)`. Returns how many points were tried."""
    k = 1
    while True:
        try:
            with _killed_at(k) as calls:
                save_new()
        except _Killed:
            check(k)
            k += 1
            continue
        assert calls[0] < k
        return k - 1


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_save_killed_anywhere_leaves_the_last_complete_checkpoint_loadable(
    tmp_path, monkeypatch, exchange
):
    """Invariant 7: a save killed at any point leaves the checkpoint of the previous save (or,
    once switched, the new one) whole at `path`, and the next save clears the leftovers."""
    if not exchange:  # a file system without an atomic exchange: the parked-version fallback
        monkeypatch.setattr(tf.checkpoint, "_exchange", lambda a, b: False)
    old = _state()
    batch = pack(random_features(2))
    new, _ = tf.step(old, tf.fwd_bwd(old, batch)[0], donate=False)
    path = tmp_path / "ckpt"
    versions = {0: old, 1: new}

    def check(k):
        loaded = tf.checkpoint.load(_state(seed=2), path)
        want = versions[int(loaded.step)]
        for name, p in want.params.items():
            assert torch.equal(loaded.params[name], p), (k, name)
        assert tf.checkpoint.read_extra(path) == {"v": int(loaded.step)}
        tf.checkpoint.save(old, path, extra={"v": 0})  # cleans up, and resets for the next k
        assert [p.name for p in tmp_path.iterdir()] == ["ckpt"], k

    tf.checkpoint.save(old, path, extra={"v": 0})
    points = _kill_every_point(lambda: tf.checkpoint.save(new, path, extra={"v": 1}), check)
    assert points > 5
    assert int(tf.checkpoint.load(_state(seed=2), path).step) == 1


def test_adapter_save_killed_anywhere_resumes_from_the_last_complete_save(tmp_path):
    """The class API's adapter + optimizer-state save is one switch: killed at any point,
    `resume_from_checkpoint` restores the previous save or the new one, never a mix."""
    from twinkle.model import TransformersModel

    lora = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}

    def model():
        m = TransformersModel(config=tiny_config(), mixed_precision="no", seed=0)
        m.add_adapter_to_model("a", lora)
        m.set_optimizer("AdamW", lr=1e-2)
        return m

    trained = model()
    saved = {}
    for step in (1, 2):
        trained.forward_backward(inputs=random_features(2, seed=step))
        trained.clip_grad_and_step()
        saved[step] = {n: p.clone() for n, p in trained.get_state_dict().items()}
        if step == 1:
            path = trained.save("ckpt", output_dir=tmp_path, save_optimizer=True)

    def check(k):
        resumed = model()
        info = resumed.resume_from_checkpoint(path)
        got = resumed.get_state_dict()
        for name, p in saved[info["cur_step"]].items():
            assert torch.equal(got[name], p), (k, name)

    def save_new():
        trained.save("ckpt", output_dir=tmp_path, save_optimizer=True)

    assert _kill_every_point(save_new, check) > 5
    assert model().resume_from_checkpoint(path)["cur_step"] == 2


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


# A refused load writes nothing: each damaged or foreign checkpoint below is refused, naming the
# tensor and the file, and the state it was loaded into is still usable and bit-identical.

Q = "model.layers.0.self_attn.q_proj.weight"


def _edit_weights(path, edit):
    """Rewrite the checkpoint's ``model.safetensors`` with `edit` applied to its tensors."""
    file = path / "model.safetensors"
    tensors = edit(load_file(file))
    save_file(tensors, file, metadata={"format": "pt"})


def _nan(tensors):
    tensors[Q][0, 0] = float("nan")
    return tensors


def _truncate(path):
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])


def _opt_nan(path):
    meta = torch.load(path / "twinkle_state.pt", weights_only=True)
    meta["opt_leaves"][-1].view(-1)[0] = float("inf")
    torch.save(meta, path / "twinkle_state.pt")


def _foreign(**overrides):
    """Save a state of another config (qwen2 with `overrides`, or a llama) as a directory maker."""

    def make(path):
        family = overrides.pop("family", "qwen2")
        model = tf.models.from_hf_config(tiny_config(family, **overrides), seed=0, device="cpu")
        tf.checkpoint.save(
            tf.init(model, tf.optim.chain(tf.optim.clip_by_global_norm(1.0), tf.optim.adamw(1e-2))),
            path,
        )

    return make


DAMAGES = {
    "another hidden size": (
        _foreign(hidden_size=64),
        r"tensor 'model.embed_tokens.weight' has shape \(96, 64\) in .*model\.safetensors, "
        r"the model expects \(96, 32\)",
    ),
    "another family": (
        _foreign(family="llama"),
        r"holds a 'llama' model \(config.json\), this state a 'qwen2' one",
    ),
    "a missing tensor": (
        lambda p: _edit_weights(
            p, lambda t: {k: v for k, v in t.items() if k != "model.norm.weight"}
        ),
        r"lacks 1 tensors the model has, e.g. \['model.norm.weight'\]",
    ),
    "an extra tensor": (
        lambda p: _edit_weights(
            p, lambda t: {**t, "model.layers.2.mlp.up_proj.weight": t[Q].clone()}
        ),
        r"holds 1 tensors the model lacks, e.g. \['model.layers.2.mlp.up_proj.weight'\]",
    ),
    "NaN bytes": (
        lambda p: _edit_weights(p, _nan),
        rf"tensor '{Q}' in .*model\.safetensors holds NaN",
    ),
    "a truncated file": (_truncate, r"model\.safetensors: tensor .* the file is truncated"),
}


def _damaged(root, what):
    """A checkpoint of `_state()` damaged by `what` (built once per name under `root`)."""
    path = root / what.replace(" ", "_")
    if not path.exists():
        if what in ("another hidden size", "another family"):
            DAMAGES[what][0](path)
        else:
            tf.checkpoint.save(_state(), path)
            {**{k: v[0] for k, v in DAMAGES.items()}, **EXTRA_DAMAGES}[what](path)
    return path


EXTRA_DAMAGES = {
    "another dtype": lambda p: _edit_weights(
        p, lambda t: {**t, "model.norm.weight": t["model.norm.weight"].half()}
    ),
    "NaN in the optimizer state": _opt_nan,
}


def _assert_intact(state, before):
    """`state` is live, bit-identical to `before`, and takes a real step (returned)."""
    assert not state.donated
    for a, b in zip(tree_leaves(state), tree_leaves(before), strict=True):
        assert torch.equal(a, b)
    return tf.step(state, tf.fwd_bwd(state, pack(random_features(2)))[0])[0]


@pytest.fixture(scope="module")
def damaged_root(tmp_path_factory):
    return tmp_path_factory.mktemp("damaged")


@pytest.mark.parametrize("what", list(DAMAGES))
@pytest.mark.parametrize("how", ["load", "load_weights"])
def test_a_foreign_or_damaged_checkpoint_is_refused_before_anything_is_written(
    damaged_root, what, how
):
    path = _damaged(damaged_root, what)
    state = _state(seed=1)
    before = state.copy()
    load = tf.checkpoint.load if how == "load" else tf.checkpoint.load_weights
    with pytest.raises(ValueError, match=DAMAGES[what][1]):
        load(state, path)
    _assert_intact(state, before)


def test_another_dtype_is_refused_by_load_and_cast_by_load_weights(damaged_root):
    """A checkpoint of this state holds its dtypes; an HF release may hold any float dtype."""
    path = _damaged(damaged_root, "another dtype")
    state = _state(seed=1)
    before = state.copy()
    with pytest.raises(
        ValueError, match=r"'model.norm.weight' is torch.float16 in .*expects torch.float32"
    ):
        tf.checkpoint.load(state, path)
    state = _assert_intact(state, before)
    tf.checkpoint.load_weights(state, path)
    assert torch.equal(
        state.params["model.norm.weight"],
        load_file(path / "model.safetensors")["model.norm.weight"].float(),
    )


def test_nan_in_the_optimizer_state_is_refused(damaged_root):
    path = _damaged(damaged_root, "NaN in the optimizer state")
    state = _state(seed=1)
    before = state.copy()
    with pytest.raises(ValueError, match=r"tensor '.*' holds NaN or infinity"):
        tf.checkpoint.load(state, path)
    _assert_intact(state, before)


def _scheduled(steps, bad_at):
    """A state after `steps` steps whose schedule gives NaN from step `bad_at` on."""
    model = tf.models.from_hf_config(tiny_config(), seed=1, device="cpu")
    schedule = lambda n: 1e-2 if n < bad_at else float("nan")  # noqa: E731
    tx = tf.optim.chain(tf.optim.clip_by_global_norm(1.0), tf.optim.adamw(schedule))
    state = tf.init(model, tx)
    for i in range(steps):
        state, _ = tf.step(state, tf.fwd_bwd(state, pack(random_features(2, seed=i)))[0])
    return state


def _other_grads(state):
    small = tf.models.from_hf_config(tiny_config(intermediate_size=32), seed=0, device="cpu")
    other = tf.init(small, tf.optim.adamw(1e-2))
    return tf.fwd_bwd(other, pack(random_features(2)))[0]


def _poisoned(state):
    grads = tf.fwd_bwd(state, pack(random_features(2)))[0]
    grads.params[Q].view(-1)[0] = float("nan")
    return grads


STEP_FAILURES = {
    "schedule turns NaN": lambda s: tf.step(s, tf.fwd_bwd(s, pack(random_features(2)))[0]),
    "no grads": lambda s: tf.step(s, None),
    "grads of another model": lambda s: tf.step(s, _other_grads(s)),
    "non-finite grads": lambda s: tf.step(s, _poisoned(s), on_nonfinite="raise"),
}
LOAD_FAILURES = [*DAMAGES, *EXTRA_DAMAGES]


@settings(max_examples=10, deadline=None)
@given(
    failure=st.sampled_from(
        [("step", f) for f in STEP_FAILURES]
        + [(how, d) for how in ("load", "load copy") for d in LOAD_FAILURES]
        + [("load_weights", d) for d in DAMAGES]  # it casts dtypes, reads no optimizer state
    ),
    steps=st.integers(0, 2),
)
def test_any_failed_load_or_step_leaves_its_input_usable_and_bit_identical(
    damaged_root, failure, steps
):
    """Invariant 7's last clause as a property: whatever raises inside `tf.checkpoint.load`,
    `load_weights` or `tf.step`, on a state of any age, the state is not donated, every tensor
    of it (parameters, optimizer state, step, RNG key) is bit-identical, and a real step runs."""
    how, what = failure
    state = _scheduled(steps, bad_at=steps if what == "schedule turns NaN" else 10**9)
    before = state.copy()
    with pytest.raises((ValueError, TypeError, tf.NonFiniteError)):
        if how == "step":
            STEP_FAILURES[what](state)
        elif how == "load_weights":
            tf.checkpoint.load_weights(state, _damaged(damaged_root, what))
        else:
            tf.checkpoint.load(state, _damaged(damaged_root, what), donate=how == "load")
    assert not state.donated
    for a, b in zip(tree_leaves(state), tree_leaves(before), strict=True):
        assert torch.equal(a, b)
    sane = tf.optim.chain(tf.optim.clip_by_global_norm(1.0), tf.optim.adamw(1e-2))
    state = state.replace(tx=sane)
    new, info = tf.step(state, tf.fwd_bwd(state, pack(random_features(2)))[0])
    assert int(new.step) == steps + 1 and torch.isfinite(info["loss"])
