"""The gradients pending between optimizer steps, and the metrics of the calls that made them.

Micro-batch gradients are summed (token sums, as `tf.fwd_bwd` returns them) until a step is
due; then the step clips (when asked), applies one update normalised by all their tokens
(`tf.step`), and records its metrics.

Nothing here reads a value back to the host while training: a micro-batch's loss sum and token
count, and a step's loss, gradient norm and token count, stay the core's device tensors (so the
host queues the next micro-batch while the device still computes this one). They become Python
numbers only when a caller asks for them: `read_loss` for a call's return value, `metrics` for
``calculate_metric``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

import twinkle_fn as tf
from twinkle_fn.losses import TokenLoss


@dataclasses.dataclass
class Pending:
    """The summed gradients of the micro-batches since the last step, the clip norm chosen for
    the coming step, and the metrics of the last step (device tensors until `metrics`)."""

    grads: tf.Grads | None = None
    clip: float | None = None
    last_step: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Calls to `add`, not the core's count: a megatron pipeline splits each call further.
    micro_batches: int = 0
    # Every call to `add` since the group began, steps or not (upstream's ``cur_step``).
    seen: int = 0
    # Whether an update consumed the micro-batches added since the last update: a later `step`
    # finds nothing new and is a no-op, not an error (upstream's clip_grad_norm / step loop
    # after `MegatronModel.clip_grad_norm` made the update).
    updated: bool = False

    def add(
        self,
        state: tf.TrainState,
        batch: Mapping[str, torch.Tensor],
        *,
        counts: bool = True,
        loss: TokenLoss | None = None,
    ) -> dict[str, torch.Tensor]:
        """Forward and backward of `loss` (None: the fused cross entropy) on `batch`, adding
        its gradients (one more micro-batch unless `counts` is False: a later part of the same
        one). Returns the core's ``loss_sum`` and ``num_tokens`` of `batch` (0-d device
        tensors, not read here; `read_loss` gives the numbers), and the ``logps``
        ``[batch, seq]`` of backends whose forward yields them (megatron's)."""
        self.grads, aux = tf.fwd_bwd(state, batch, accum=self.grads, loss=loss)
        self.micro_batches += counts
        self.seen += counts
        self.updated = False
        return aux

    def check_any(self, call: str) -> None:
        """Raises ``ValueError`` when `call` (a step) finds no micro-batch: none added since the
        last update (which did not consume any) or since `clear`."""
        if self.micro_batches == 0 and not self.updated:
            raise ValueError(
                f"{call}() found no accumulated micro-batch: nothing to update since the last "
                "step or zero_grad; call forward_backward(inputs=...) (or forward + backward) "
                "before it"
            )

    def due(self, accumulation_steps: int) -> bool:
        """Whether the pending gradients hold (at least) the micro-batches of one step."""
        return self.grads is not None and self.micro_batches >= accumulation_steps

    def grad_norm(self, state: tf.TrainState) -> float:
        """The global L2 norm of the token-normalised pending gradients, any float16 loss scale
        divided out (`tf.grad_norm`: the norm `tf.step` will report). A collective on several
        ranks."""
        assert self.grads is not None
        return float(tf.grad_norm(state, self.grads))

    def apply(self, state: tf.TrainState) -> tf.TrainState:
        """`state` after one update of its own transform from the pending gradients (then
        cleared); records ``last_step`` (the core's tensors, read by `metrics`)."""
        assert self.grads is not None
        state, info = tf.step(state, self.grads, on_nonfinite="raise")
        self.clear()
        self.updated = True
        self.last_step = {
            "loss": info["loss"],
            "grad_norm": info["grad_norm"],
            "lr": info["lr"],
            "num_tokens": info["num_tokens"],
            "step": int(state.step),  # a host tensor: no wait for the device
        }
        return state

    def metrics(self) -> dict[str, Any]:
        """The last step's ``loss`` (token mean), ``grad_norm`` (before clipping), ``lr``,
        ``num_tokens`` and ``step`` as Python numbers (read back from the device now); empty
        before the first step."""
        if not self.last_step:
            return {}
        m = self.last_step
        return {
            "loss": float(m["loss"]),
            "grad_norm": float(m["grad_norm"]),
            "lr": m["lr"],
            "num_tokens": int(m["num_tokens"]),
            "step": m["step"],
        }

    def clear(self) -> None:
        """Drop the pending gradients and the clip norm."""
        self.grads, self.clip, self.micro_batches = None, None, 0


def read_loss(loss_sum: torch.Tensor, num_tokens: torch.Tensor) -> dict[str, float | int]:
    """A call's token-mean ``loss`` (float; 0 without tokens) and ``num_tokens`` (int) from
    its token sums, 0-d tensors (summed on the device over the call's parts). Reads them back
    to the host: call it only for a value the caller returns."""
    count = int(num_tokens)
    return {"loss": float(loss_sum) / max(count, 1), "num_tokens": count}
