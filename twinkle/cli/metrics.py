"""`twinkle train`'s metrics: one JSON line per step (and per evaluation), and TensorBoard
scalars when ``tensorboard`` is importable (``pip install twinkle[tensorboard]``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psutil
import torch
from transformers import PretrainedConfig

# Dense bf16 peak FLOP/s of the cards whose peak is known (MFU is None elsewhere, CPU included).
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def peak_flops() -> float | None:
    """The dense bf16 peak of this process's CUDA device when known, else None."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for card, peak in PEAK_FLOPS.items() if card in name), None)


def flops_per_token(config: PretrainedConfig, seq: int) -> float:
    """Training FLOPs per token, ``6 N + 6 L H S`` (N: parameters outside the embedding
    lookup, counting the lm_head; S: the tokens a sequence attends over)."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    attn = hidden * head_dim * (2 * heads + 2 * kv)
    mlp = 3 * hidden * config.intermediate_size
    matmul = layers * (attn + mlp) + hidden * config.vocab_size
    return 6 * matmul + 6 * layers * hidden * seq


def memory_gb() -> float:
    """Peak device memory allocated (CUDA), else this process's resident memory, in GB."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 1e9
    return psutil.Process().memory_info().rss / 1e9


class MetricsLog:
    """Appends records to ``<dir>/metrics.jsonl`` and, when importable and asked for, writes
    their numbers to TensorBoard under ``<dir>/tensorboard``. Only rank 0 is given one."""

    def __init__(self, directory: Path, tensorboard: bool) -> None:
        self._file = (directory / "metrics.jsonl").open("a")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is an optional extra
                pass
            else:
                self._tb = SummaryWriter(str(directory / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        """Log `record` (``step`` and numbers; None for a number not known)."""
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
