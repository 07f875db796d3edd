"""Invariant 7 under a kill: a `tf.checkpoint` save, or the class API's adapter save, killed at
any file-system call (every later call, cleanup included, fails as if the process were
SIGKILLed) leaves the last complete checkpoint loadable, and the next save clears the
leftovers."""

import builtins
import contextlib
import os
import shutil

import pytest
import torch

import twinkle_fn as tf
from twinkle_fn.checkpoint_test import _state
from twinkle_fn.data import pack
from twinkle_fn.testing import random_features, tiny_config


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
