"""Weights out of a trainer, to a rollout engine: a stream of HF-named, size-bounded buckets.

::

    for bucket in tf.export_weights(state):      # every rank iterates: it is a collective
        engine.load_weights(bucket)              # vLLM / SGLang: an iterable of (name, tensor)

Each bucket is a list of ``(hf_name, tensor)``: whole tensors in the HF checkpoint layout (fused
qkv / gate-up split back, vocabulary padding trimmed, MoE experts one tensor per expert, as
in HF checkpoints, on both backends), on the model's device, in `dtype`. The backend gathers each tensor inside the
group of ranks that holds its pieces (tensor-parallel shards within the tp group, pipeline
stages in turn from the stage that owns them, experts from their expert-parallel ranks, FSDP
shards one parameter at a time), so no rank ever holds more than the current bucket and the
tensor being gathered, never the whole model. Every rank receives the same buckets, so any rank
can feed a colocated engine or forward the bucket to another process.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from twinkle_fn import backends
from twinkle_fn.state import TrainState

LORA_MODES = ("separate", "merged")
DEFAULT_BUCKET_BYTES = 512 << 20


def export_weights(
    state: TrainState,
    *,
    dtype: torch.dtype = torch.bfloat16,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    lora: str = "separate",
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The state's model weights as a stream of buckets of ``(hf_name, tensor)`` (a collective:
    every rank iterates the whole stream, in step with the others).

    Each bucket holds at most `bucket_bytes` bytes of tensor data, unless one tensor alone is
    larger (it then goes alone). The tensors are whole (never shards), in `dtype`, on the
    model's device; they may share memory with the model's parameters (on one rank, or a
    tensor no rank splits), so copy one before modifying it. For a model that
    trains LoRA adapters, ``lora="separate"`` yields the adapter only, keyed as in a peft
    adapter file (`twinkle_fn.lora.adapter_state_dict`; the frozen base is what the engine
    loaded already), and ``lora="merged"`` yields every base weight with the adapter's update
    ``W + scaling * B @ A`` merged in (HF names, no adapter tensors). Without adapters `lora`
    changes nothing.

    Raises (eagerly, before any communication) ``ValueError`` for a bad `bucket_bytes`, `lora`
    or non-floating `dtype`, and ``DonatedError`` for a donated state.
    """
    state.check_alive()
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    if lora not in LORA_MODES:
        raise ValueError(f"lora must be one of {LORA_MODES}, got {lora!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    return backends.get(state.model.backend).export_weights(state, dtype, bucket_bytes, lora)
