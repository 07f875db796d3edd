"""`tf.export_weights` on one process, and the consumers the multi-rank tests reuse.

Tolerance: the consumer's per-token log-probabilities equal the trainer's to 1e-5 absolute in
float32: the same weights (exported in float32, bit for bit) run through the same HF layers,
the trainer's fused lm_head / loss only reorders float32 sums (observed <= 2e-6).
"""

import json
import os

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from transformers.core_model_loading import revert_weight_conversion

import twinkle_fn as tf
from twinkle_fn.backends.buckets import nbytes
from twinkle_fn.backends.transformers.compute import model_inputs
from twinkle_fn.data import pad_collate
from twinkle_fn.losses import token_logps
from twinkle_fn.testing import random_features, tiny_config

LOGPS_ATOL = 1e-5
LORA = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)


def train(model, mesh=None, steps=2, feats_of=lambda feats: feats, batch_of=None, tx=None):
    """`steps` AdamW steps of `model` on `mesh` (each rank its slice of each batch)."""
    batch_of = batch_of or (lambda f: pad_collate(f, pad_token_id=0))
    state = tf.init(model, tx or tf.optim.adamw(1e-2), mesh)
    for i in range(steps):
        grads, _ = tf.fwd_bwd(state, batch_of(feats_of(random_features(8, seed=10 + i))))
        state, _ = tf.step(state, grads)
    return state


def batch():
    """The batch trainer and consumer are compared on."""
    return pad_collate(random_features(4, seed=99), pad_token_id=0)


def consume(stream, config, bucket_bytes, files_dir=None):
    """An HF model built from `stream`, checking it: every name known and received once, every
    bucket within `bucket_bytes` (or one tensor). Buckets are loaded one at a time with
    ``load_state_dict(strict=False)``; with `files_dir` (checkpoint names that the in-memory
    module fuses, e.g. per-expert MoE tensors) each is written as one safetensors file and the
    model read with ``from_pretrained``. Returns ``(model, largest bucket bytes)``."""
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # the checkpoint's tensors: parameters and persistent buffers (a router's expert bias)
    wanted = sorted(revert_weight_conversion(hf, dict(hf.state_dict())))
    seen, largest, index = [], 0, {}
    for i, bucket in enumerate(stream):
        size = sum(nbytes(t) for _, t in bucket)
        assert size <= bucket_bytes or len(bucket) == 1, (size, [n for n, _ in bucket])
        largest = max(largest, size)
        seen += [n for n, _ in bucket]
        if files_dir is None:
            _, unexpected = hf.load_state_dict(dict(bucket), strict=False)
            assert not unexpected, unexpected
        else:
            save_file(
                {n: t.contiguous() for n, t in bucket},
                os.path.join(files_dir, f"model-{i}.safetensors"),
            )
            index.update({n: f"model-{i}.safetensors" for n, _ in bucket})
    assert sorted(seen) == wanted  # each checkpoint tensor once, nothing else
    if files_dir is not None:
        with open(os.path.join(files_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": index}, f)
        config.save_pretrained(files_dir)
        hf = AutoModelForCausalLM.from_pretrained(files_dir, dtype=torch.float32).eval()
    return hf, largest


def hf_logps(hf, batch):
    with torch.no_grad():
        logits = hf(**model_inputs(batch, torch.device("cpu")), use_cache=False).logits
    return token_logps(logits, batch["labels"])


def model_bytes(config):
    """The float32 model's total bytes and its largest tensor's."""
    sizes = [nbytes(p) for p in AutoModelForCausalLM.from_config(config).parameters()]
    return sum(sizes), max(sizes)


def test_the_stream_loads_into_an_hf_model_with_the_trainer_logits():
    config = tiny_config("qwen2")
    state = train(tf.models.from_hf_config(config, seed=0))
    (total, biggest), bound = model_bytes(config), 16 << 10
    hf, largest = consume(
        tf.export_weights(state, dtype=torch.float32, bucket_bytes=bound), config, bound
    )
    want = tf.token_logps(state, batch())["logps"]
    torch.testing.assert_close(hf_logps(hf, batch()), want, rtol=0, atol=LOGPS_ATOL)
    # Each bucket within the bound unless one tensor alone is bigger (the embedding), and far
    # below the whole model: only one bucket is ever held.
    assert largest <= max(bound, biggest) and largest < total / 2


def test_bf16_export_and_lora_modes():
    config = tiny_config("qwen2")
    model = tf.models.from_hf_config(config, seed=0)
    model = tf.lora.add_lora(model, LORA)
    state = train(model)
    separate = [kv for b in tf.export_weights(state, lora="separate") for kv in b]
    want = tf.lora.adapter_state_dict(state)
    assert [n for n, _ in separate] == list(want)
    for name, tensor in separate:
        assert tensor.dtype == torch.bfloat16
        torch.testing.assert_close(tensor, want[name].to(torch.bfloat16), rtol=0, atol=0)
    bound = 1 << 20
    merged = tf.export_weights(state, dtype=torch.float32, bucket_bytes=bound, lora="merged")
    hf, _ = consume(merged, config, bound)
    want = tf.token_logps(state, batch())["logps"]
    torch.testing.assert_close(hf_logps(hf, batch()), want, rtol=0, atol=LOGPS_ATOL)
    base = tf.token_logps(state, batch(), disable_lora=True)["logps"]
    assert (want - base).abs().max() > 1e-3  # the adapter changed the model: merging mattered


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(bucket_bytes=0), "bucket_bytes"),
        (dict(bucket_bytes=1.5), "bucket_bytes"),
        (dict(lora="fused"), "lora"),
        (dict(dtype=torch.int8), "dtype"),
    ],
)
def test_bad_arguments_are_refused_before_streaming(kwargs, match):
    state = tf.init(tf.models.from_hf_config(tiny_config("qwen2"), seed=0), tf.optim.adamw(1e-3))
    with pytest.raises(ValueError, match=match):
        tf.export_weights(state, **kwargs)
