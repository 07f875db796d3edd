"""Upstream's weight-sync entry points on both model classes (`weight_buckets`, `send_weights`,
`MegatronModel.get_hf_state_dict`): after a LoRA training step, the stream loaded bucket by
bucket into a plain HF model (merged: every weight; separate: the adapter into peft over the
checkpoint the trainer started from) gives the trainer's per-token log-probs. float32 throughout:
the same weights and computation, so log-probs agree to 1e-5 absolute.

The megatron runs go in one spawned process (megatron-core needs a process group); the parent
loads and compares.
"""

import runpy
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from transformers import AutoModelForCausalLM

from twinkle.model import MegatronModel, TransformersModel
from twinkle_fn.backends.megatron import parallel
from twinkle_fn.lora import PEFT_PREFIX
from twinkle_fn.testing import random_features
from twinkle_fn.testing_dist import spawn

LORA = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
COOKBOOK = Path(__file__).resolve().parent.parent / "cookbook"
ATOL = 1e-5
BUCKET_BYTES = 4096  # several buckets even for the tiny model


class _Engine:
    """A colocated engine's stand-in: records each `load_weights` call."""

    def __init__(self):
        self.calls = []

    def load_weights(self, weights):
        self.calls.append(list(weights))


def _feats():
    return random_features(3, seed=5)


def _train_and_export(model):
    """One LoRA step, then the trainer's log-probs and its streams, merged and separate."""
    model.add_adapter_to_model("default", LORA)
    optimizer = "default" if isinstance(model, MegatronModel) else "AdamW"
    model.set_optimizer(optimizer, adapter_name="default", lr=1e-2)
    model.forward_backward(inputs=random_features(4, seed=1))
    model.clip_grad_and_step()
    kw = dict(dtype=torch.float32, bucket_bytes=BUCKET_BYTES)
    engine = _Engine()
    model.send_weights(base_sync_done=True, engine=engine, **kw)
    return dict(
        logps=model.forward_only(inputs=_feats())["logps"],
        merged=list(model.weight_buckets(merge_and_sync=True, **kw)),
        separate=list(model.weight_buckets(merge_and_sync=False, **kw)),
        sent=engine.calls,
    )


def _megatron(model_dir):
    model = MegatronModel(model_id=model_dir, mixed_precision="no", seed=0)
    run = _train_and_export(model)
    run["hf_state_dict"] = list(model.get_hf_state_dict(dtype=torch.float32))
    run["hf_state_dict_merged"] = list(
        model.get_hf_state_dict(merge_lora=True, dtype=torch.float32)
    )
    parallel.destroy()
    return run


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    make = runpy.run_path(str(COOKBOOK / "make_tiny_model.py"))["make_tiny_model"]
    return make(tmp_path_factory.mktemp("weight_sync") / "tiny", hidden_size=32)


@pytest.fixture(scope="module")
def runs(model_dir):
    model = TransformersModel(model_id=model_dir, mixed_precision="no", seed=0)
    return {
        "transformers": _train_and_export(model),
        "megatron": spawn(_megatron, 1, str(model_dir), timeout_s=300)[0],
    }


def _hf_logps(model, feats):
    """Per-token log-probs of each feature's labels (0 where unsupervised), one row each."""
    rows = []
    with torch.no_grad():
        for f in feats:
            logits = model(input_ids=torch.tensor([f["input_ids"]])).logits[0].float()
            labels = torch.tensor(f["labels"])
            got = logits.log_softmax(-1).gather(-1, labels.clamp(min=0)[:, None])[:, 0]
            rows.append(torch.where(labels >= 0, got, 0.0))
    return rows


def _assert_same_logps(want, hf):
    feats = _feats()
    for i, (row, f) in enumerate(zip(_hf_logps(hf, feats), feats, strict=True)):
        mask = torch.tensor(f["labels"]) >= 0
        torch.testing.assert_close(want[i, : len(row)][mask].float(), row[mask], rtol=0, atol=ATOL)


def _load_merged(model_dir, buckets):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    loaded = set()
    for bucket in buckets:
        assert sum(t.numel() * t.element_size() for _, t in bucket) <= BUCKET_BYTES or (
            len(bucket) == 1
        )
        result = hf.load_state_dict(dict(bucket), strict=False)
        assert result.unexpected_keys == []
        loaded |= {n for n, _ in bucket}
    # Every weight came (a tied output embedding comes once, as the input embedding).
    assert set(hf.state_dict()) - loaded <= {"lm_head.weight"}
    return hf


def _load_separate(model_dir, buckets):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(hf, LORA).eval()
    adapter = set()
    for bucket in buckets:
        assert all(n.startswith(PEFT_PREFIX) and ".lora_" in n for n, _ in bucket)
        result = set_peft_model_state_dict(peft_model, dict(bucket))
        assert [k for k in result.unexpected_keys if "lora" in k] == []
        adapter |= {n for n, _ in bucket}
    want = {k for k in peft_model.state_dict() if ".lora_" in k}
    assert len(adapter) == len(want) > 0
    return peft_model


@pytest.mark.parametrize("cls", ["transformers", "megatron"])
def test_merged_stream_gives_the_trainers_logps(runs, model_dir, cls):
    run = runs[cls]
    assert len(run["merged"]) > 1
    hf = _load_merged(model_dir, run["merged"])
    _assert_same_logps(run["logps"], hf)
    # The trained adapter is in the merged weights: the base checkpoint differs.
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    feats = _feats()
    assert (_hf_logps(base, feats)[0] - _hf_logps(hf, feats)[0]).abs().max() > 1e-3


@pytest.mark.parametrize("cls", ["transformers", "megatron"])
def test_separate_stream_is_the_adapter_and_gives_the_trainers_logps(runs, model_dir, cls):
    run = runs[cls]
    _assert_same_logps(run["logps"], _load_separate(model_dir, run["separate"]))


@pytest.mark.parametrize("cls", ["transformers", "megatron"])
def test_send_weights_feeds_the_engine_upstreams_names(runs, cls):
    run = runs[cls]
    want = [[(n.removeprefix(PEFT_PREFIX), t) for n, t in b] for b in run["separate"]]
    assert [[n for n, _ in b] for b in run["sent"]] == [[n for n, _ in b] for b in want]
    assert all(
        torch.equal(t, u)
        for b, c in zip(run["sent"], want, strict=True)
        for (_, t), (_, u) in zip(b, c, strict=True)
    )


def test_megatron_get_hf_state_dict_is_the_flat_stream(runs):
    run = runs["megatron"]
    for flat, buckets in [
        (run["hf_state_dict"], run["separate"]),
        (run["hf_state_dict_merged"], run["merged"]),
    ]:
        want = [item for b in buckets for item in b]
        assert [n for n, _ in flat] == [n for n, _ in want]
        assert all(torch.equal(t, u) for (_, t), (_, u) in zip(flat, want, strict=True))


def test_send_weights_refuses_what_it_cannot_do(model_dir):
    model = TransformersModel(model_id=model_dir, mixed_precision="no", seed=0)
    with pytest.raises(ValueError, match="send_weights needs engine="):
        model.send_weights()
    with pytest.raises(ValueError, match="load_weights"):
        model.send_weights(engine=object())
    model.add_adapter_to_model("default", LORA)
    with pytest.raises(ValueError, match="base_sync_done=True, or merge_and_sync=True"):
        model.send_weights(engine=_Engine())
