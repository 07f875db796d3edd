"""The pending gradients keep their metrics on the device: nothing is read back to the host
while micro-batches accumulate or a step is made, only when a caller asks for a number.

On CPU there is no device to wait for, so the core's outputs are wrapped in `_Watched`, a tensor
whose every read back to Python (``item``, ``float``, ``int``, ``bool``, ``tolist``) is
counted; on CUDA the same reads are what `twinkle_fn.testing.no_host_sync` turns into errors.
"""

from collections.abc import Callable
from typing import Any

import pytest
import torch

import twinkle_fn as tf
from twinkle.model import TransformersModel
from twinkle.model._accumulate import Pending, read_loss
from twinkle_fn.data import pad_collate
from twinkle_fn.testing import random_features, tiny_config


class _Watched(torch.Tensor):
    """A tensor that counts the reads of its values into Python (results of operations on it
    are `_Watched` too, so sums of watched tensors stay watched)."""

    reads = 0

    def _read(self, how: str) -> Any:
        _Watched.reads += 1
        with torch._C.DisableTorchFunctionSubclass():
            return getattr(torch.Tensor, how)(self)

    def item(self) -> Any:
        return self._read("item")

    def tolist(self) -> Any:
        return self._read("tolist")

    def __float__(self) -> float:
        return self._read("__float__")

    def __int__(self) -> int:
        return self._read("__int__")

    def __index__(self) -> int:
        return self._read("__index__")

    def __bool__(self) -> bool:
        return self._read("__bool__")


def _watch(fn: Callable[..., tuple[Any, dict[str, Any]]]) -> Callable[..., Any]:
    """`fn` (``tf.fwd_bwd`` / ``tf.step``) with the tensors of its returned dict watched."""

    def watched(*args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        first, info = fn(*args, **kwargs)
        return first, {
            k: v.as_subclass(_Watched) if isinstance(v, torch.Tensor) else v
            for k, v in info.items()
        }

    return watched


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matrices: torch's intra-op threads only contend on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def reads(monkeypatch):
    """Watch what `tf.fwd_bwd` and `tf.step` return; yields a function giving the read count."""
    monkeypatch.setattr(tf, "fwd_bwd", _watch(tf.fwd_bwd))
    monkeypatch.setattr(tf, "step", _watch(tf.step))
    monkeypatch.setattr(_Watched, "reads", 0)
    return lambda: _Watched.reads


def test_watched_tensors_count_every_read(reads):
    t = torch.tensor(3.0).as_subclass(_Watched)
    total = t + t
    assert isinstance(total, _Watched) and reads() == 0
    assert (float(total), int(t), t.item(), bool(t)) == (6.0, 3, 3.0, True)
    assert reads() == 4


def test_accumulation_and_step_read_nothing_until_asked(reads):
    model = tf.models.from_hf_config(tiny_config(), seed=0)
    state = tf.init(model, tf.optim.adamw(1e-2))
    pending = Pending()
    batches = [pad_collate(random_features(2, seed=s), 0) for s in range(3)]
    auxes = [pending.add(state, batch) for batch in batches]
    loss_sum = sum(aux["loss_sum"] for aux in auxes)  # summed on the device
    num_tokens = sum(aux["num_tokens"] for aux in auxes)
    assert isinstance(loss_sum, _Watched) and isinstance(num_tokens, _Watched)
    assert pending.due(3) and reads() == 0
    state = pending.apply(state)
    assert all(isinstance(pending.last_step[k], _Watched) for k in ("loss", "grad_norm"))
    assert reads() == 0  # nothing was read back during accumulation or the step
    calls = read_loss(loss_sum, num_tokens)
    assert reads() == 2 and type(calls["loss"]) is float and type(calls["num_tokens"]) is int
    metrics = pending.metrics()
    assert reads() == 5 and metrics["step"] == 1
    # The step normalises over the tokens of all 3 micro-batches: their summed token mean.
    assert metrics["num_tokens"] == calls["num_tokens"]
    assert metrics["loss"] == pytest.approx(calls["loss"], rel=1e-6)


def test_class_api_reads_metrics_only_when_it_returns_them(reads):
    """Upstream's split loop (forward, backward, step, zero_grad, lr_step) reads nothing back;
    calculate_metric and forward_backward's return value read their numbers."""
    model = TransformersModel(config=tiny_config(), mixed_precision="no", seed=0)
    feats = random_features(3, seed=1)
    model.forward(inputs=feats)  # its own no-grad forward: not watched
    model.backward()
    model.step()
    model.zero_grad()
    model.lr_step()
    assert int(model.state.step) == 1 and reads() == 0
    metrics = model.calculate_metric()
    assert reads() > 0 and type(metrics["loss"]) is float and type(metrics["grad_norm"]) is float
    out = model.forward_backward(inputs=feats)
    assert type(out.loss) is float and type(out.num_tokens) is int
