"""Small, deterministic models and data for tests (no download, seconds on a CPU)."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

_BASE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
_EXTRA: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {},
    "qwen3": {"head_dim": 8},
    "qwen3_moe": {
        "head_dim": 8,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "decoder_sparse_step": 1,
    },
}


def tiny_config(family: str = "qwen2", **overrides: Any) -> PretrainedConfig:
    """A 2-layer config of `family` with hidden size 32 and a 96-token vocabulary."""
    if family not in _EXTRA:
        raise ValueError(f"no tiny config for family {family!r}; known: {', '.join(_EXTRA)}")
    return AutoConfig.for_model(family, **{**_BASE, **_EXTRA[family], **overrides})


def random_features(
    n: int, *, vocab_size: int = 96, min_len: int = 3, max_len: int = 12, seed: int = 0
) -> list[dict[str, list[int]]]:
    """`n` features of random tokens with shifted labels; about a third of each prompt is masked.

    Every feature has at least one supervised token (the masked prompt is under a third).
    """
    rng = random.Random(seed)
    feats = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        ids = [rng.randrange(1, vocab_size) for _ in range(length)]
        prompt = rng.randint(0, length // 3)
        raw = [-100] * prompt + ids[prompt:]
        feats.append({"input_ids": ids, "labels": [*raw[1:], -100]})
    return feats


def run_triton_interpreted(code: str, *args: str) -> None:
    """Run Python `code` (with `args` as ``sys.argv[1:]``) in a fresh process under Triton's CPU
    interpreter, so a kernel's logic is tested without a GPU.

    A fresh process because ``TRITON_INTERPRET`` must be set before triton is first imported.
    Raises ``AssertionError`` with the end of the child's stderr if it fails.
    """
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        env=os.environ | {"TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Within the block, a CUDA call that makes the host wait for the device raises
    ``RuntimeError`` (``torch.cuda.set_sync_debug_mode("error")``); the device's queue is
    drained first, so only the block's own waits count. CUDA only."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)
