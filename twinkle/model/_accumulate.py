"""The gradients pending between optimizer steps.

Micro-batch gradients are summed (token sums, as `tf.fwd_bwd` returns them) until a step is
due; then the step clips (when asked), applies one update normalised by all their tokens
(`tf.step`), and records its metrics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

import twinkle_fn as tf


@dataclasses.dataclass
class Pending:
    """The summed gradients of the micro-batches since the last step, the clip norm chosen for
    the coming step, and the metrics of the last step."""

    grads: tf.Grads | None = None
    clip: float | None = None
    last_step: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Calls to `add`, not the core's count: a megatron pipeline splits each call further.
    micro_batches: int = 0

    def add(
        self, state: tf.TrainState, batch: Mapping[str, torch.Tensor], *, counts: bool = True
    ) -> dict[str, Any]:
        """Forward and backward on `batch`, adding its gradients (one more micro-batch unless
        `counts` is False: a later part of the same one); returns its token-mean ``loss`` and
        ``num_tokens``, and the ``logps`` ``[batch, seq]`` of backends whose forward yields
        them (megatron's)."""
        self.grads, aux = tf.fwd_bwd(state, batch, accum=self.grads)
        self.micro_batches += counts
        num_tokens = int(aux["num_tokens"])
        out = {"loss": float(aux["loss_sum"]) / max(num_tokens, 1), "num_tokens": num_tokens}
        if "logps" in aux:
            out["logps"] = aux["logps"]
        return out

    def due(self, accumulation_steps: int) -> bool:
        """Whether the pending gradients hold (at least) the micro-batches of one step."""
        return self.grads is not None and self.micro_batches >= accumulation_steps

    def set_clip(self, max_grad_norm: float, norm_type: float) -> None:
        """Clip the coming step's gradients to `max_grad_norm`. Raises ``ValueError`` for a
        norm other than L2."""
        if norm_type != 2:
            raise ValueError(f"norm_type={norm_type}: gradient clipping is by the L2 norm only")
        self.clip = max_grad_norm

    def grad_norm(self, state: tf.TrainState) -> float:
        """The global L2 norm of the token-normalised pending gradients. A collective on
        several ranks."""
        assert self.grads is not None
        return float(tf.grad_norm(state, self.grads))

    def apply(self, state: tf.TrainState) -> tf.TrainState:
        """`state` after one update of its own transform from the pending gradients (then
        cleared); records ``last_step``."""
        assert self.grads is not None
        state, info = tf.step(state, self.grads)
        self.clear()
        self.last_step = {
            "loss": float(info["loss"]),
            "grad_norm": float(info["grad_norm"]),
            "lr": info["lr"],
            "num_tokens": int(info["num_tokens"]),
            "step": int(state.step),
        }
        return state

    def clear(self) -> None:
        """Drop the pending gradients and the clip norm."""
        self.grads, self.clip, self.micro_batches = None, None, 0
