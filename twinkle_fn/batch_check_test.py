"""A bad batch is refused at the core's entry, naming field, value and fix, before any compute."""

import pytest
import torch

import twinkle_fn as tf
from twinkle_fn import backends
from twinkle_fn.batch_check import check_batch
from twinkle_fn.data import pack, pad_collate
from twinkle_fn.testing import random_features, tiny_config

VOCAB, MAX_POSITIONS = 96, 128  # tiny_config's


@pytest.fixture(scope="module")
def state():
    model = tf.models.from_hf_config(tiny_config(), seed=0, device="cpu")
    return tf.init(model, tf.optim.adamw(1e-2))


@pytest.fixture
def no_compute(state, monkeypatch):
    """Make any backend compute fail the test: a refusal must come first."""

    def fail(*args, **kwargs):
        raise AssertionError("the backend computed")

    for hook in ("fwd_bwd", "loss_of", "token_logps"):
        monkeypatch.setattr(type(backends.get(state.model.backend)), hook, fail)


def _batch(**changes):
    batch = pad_collate(random_features(3, seed=2), pad_token_id=0)
    batch.update(changes)
    return batch


def _calls(state):
    return {
        "tf.fwd_bwd": lambda batch: tf.fwd_bwd(state, batch),
        "tf.evaluate": lambda batch: tf.evaluate(state, batch),
        "tf.token_logps": lambda batch: tf.token_logps(state, batch),
    }


@pytest.mark.parametrize(
    ("edit", "error", "match"),
    [
        (
            lambda b: {"input_ids": b["input_ids"] + VOCAB},
            ValueError,
            r"batch\['input_ids'\] holds token id 1\d\d, outside the model's vocabulary \[0, 96\)",
        ),
        (
            lambda b: {"input_ids": b["input_ids"] - 200},
            ValueError,
            r"batch\['input_ids'\] holds token id -\d+",
        ),
        (
            lambda b: {"labels": b["labels"].masked_fill(b["labels"] > 0, VOCAB)},
            ValueError,
            r"batch\['labels'\] holds token id 96, .*or -100",
        ),
        (  # beside -100s, which pass: the range check must still see a negative label
            lambda b: {"labels": b["labels"].masked_fill(b["labels"] == 5, -1)},
            ValueError,
            r"batch\['labels'\] holds token id -1, .*or -100",
        ),
        (
            lambda b: {"input_ids": b["input_ids"].float()},
            TypeError,
            r"batch\['input_ids'\] holds torch.float32, token ids must be integers; convert it with .long\(\)",
        ),
        (
            lambda b: {"labels": None},
            TypeError,
            r"batch\['labels'\] must be a tensor, got NoneType",
        ),
        (
            lambda b: {"input_ids": b["input_ids"][:, :-1]},
            ValueError,
            r"input_ids \(3, \d+\) and labels \(3, \d+\) must share one \[batch, seq\] shape",
        ),
    ],
    ids=[
        "id >= vocab",
        "negative id",
        "label >= vocab",
        "negative label",
        "float ids",
        "labels None",
        "shapes",
    ],
)
def test_bad_ids_are_refused_by_every_entry_before_compute(state, no_compute, edit, error, match):
    batch = _batch()
    batch.update(edit(batch))
    for where, call in _calls(state).items():
        with pytest.raises(error, match=rf"{where}: {match}"):
            call(batch)


def test_a_batch_without_labels_is_named_not_a_key_error(state, no_compute):
    batch = _batch()
    del batch["labels"]
    for where, call in _calls(state).items():
        with pytest.raises(ValueError, match=rf"{where}: batch has no 'labels' \(fields: \["):
            call(batch)


def test_a_batch_without_supervised_tokens_is_refused_by_fwd_bwd_only(state, no_compute):
    """Zero supervised tokens would step with zero gradients; evaluating such a batch is fine
    (it counts 0 tokens), so only fwd_bwd refuses it."""
    batch = _batch()
    batch["labels"] = torch.full_like(batch["labels"], -100)
    with pytest.raises(ValueError, match="every label of this batch is -100"):
        tf.fwd_bwd(state, batch)
    check_batch(batch, state.model.config, where="tf.evaluate")
    check_batch(batch, state.model.config, where="x", supervised=True, single_process=False)


def test_sequences_longer_than_the_position_table_are_refused_naming_both(state, no_compute):
    long = random_features(2, min_len=MAX_POSITIONS + 2, max_len=MAX_POSITIONS + 2)
    for batch in (pad_collate(long, pad_token_id=0), pack(long)):
        for where, call in _calls(state).items():
            with pytest.raises(
                ValueError,
                match=rf"{where}: a sequence of this batch is 130 tokens long, but the model has max_position_embeddings=128",
            ):
                call(batch)
    # packed rows longer than the table are fine when each sequence fits: positions restart
    fits = pack(random_features(3, min_len=100, max_len=100))
    assert fits["input_ids"].shape[-1] == 300
    check_batch(fits, state.model.config, where="x", supervised=True)


def test_temperature_must_be_positive(state, no_compute):
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=f"temperature must be a positive number, got {bad}"):
            tf.token_logps(state, _batch(), temperature=bad)


def test_a_batch_on_a_device_skips_the_value_checks():
    """Reading a device batch would make the host wait for it: only metadata is checked (meta
    tensors stand in for an accelerator's here)."""
    config = tiny_config()
    far = torch.full((2, 300), 10**6, device="meta", dtype=torch.long)
    check_batch({"input_ids": far, "labels": far}, config, where="x", supervised=True)
    with pytest.raises(TypeError, match=r"holds torch\.float32"):
        check_batch({"input_ids": far.float(), "labels": far}, config, where="x")


def test_good_batches_pass(state):
    for batch in (_batch(), pack(random_features(3, seed=1))):
        tf.fwd_bwd(state, batch)
