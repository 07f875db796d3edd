"""`FusedLMHead`: an ``nn.Linear`` lm_head that can return the token-summed loss, or per-token
log-probabilities, instead of logits.

Training calls the causal LM's own ``forward`` (so wrappers such as FSDP2 see the root forward and
the head's forward, and gather, reshard and reduce their parameters as usual) while the head,
given the labels, computes the chunked fused linear + cross-entropy and never builds the
``[tokens, vocab]`` logits. Without labels it is a plain ``nn.Linear``: generation and
``save_pretrained`` see no difference, and the parameter names stay ``lm_head.weight``/``bias``.
Inside `terms_mode` it returns each token's log-probability and entropy, chunked the same way,
for the losses over per-token terms (policy gradients) and for rollouts' log-probs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from twinkle_fn.losses import fused_linear_cross_entropy_sum
from twinkle_fn.losses.fused_linear_logps import fused_linear_token_logps


class FusedLMHead(torch.nn.Linear):
    """A linear head whose forward, inside `loss_mode`, returns ``loss_sum`` (0-d float32), and
    inside `terms_mode` the per-token terms ``[batch, seq, 2]``."""

    _labels: torch.Tensor | None = None
    _rows: torch.Tensor | None = None
    _terms: tuple[float, bool] | None = None  # (temperature, with_entropy) in terms_mode

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[..., vocab]``, or inside `loss_mode` the CE sum over the labelled tokens.

        `hidden` is ``[batch, seq, hidden]``; the labels (``[batch, seq]``, already shifted) and
        their supervised rows come from `loss_mode`. Under autocast the projection runs in the autocast dtype, as a plain
        head's matmul would (the residual stream reaching the head is often float32 there); the
        softmax and the sums accumulate in float32 either way.
        """
        if self._labels is None:
            return super().forward(hidden)
        device = hidden.device.type
        dtype = (
            torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        )
        bias = None if self.bias is None else self.bias.to(dtype)
        with torch.autocast(device, enabled=False):
            if self._terms is not None:
                return self._token_terms(hidden.to(dtype), self.weight.to(dtype), bias)
            out = fused_linear_cross_entropy_sum(
                hidden.to(dtype),
                self.weight.to(dtype),
                self._labels,
                bias=bias,
                supervised_rows=self._rows,
            )
        return out.loss_sum

    def _token_terms(
        self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``[batch, seq, 2]`` float32: each token's log-probability, then its entropy (0
        when not asked for, and at ignored tokens)."""
        temperature, with_entropy = self._terms
        terms = fused_linear_token_logps(
            hidden,  # [batch, seq, hidden]
            weight,
            self._labels,
            bias=bias,
            temperature=temperature,
            with_entropy=with_entropy,
            supervised_rows=self._rows,
        )
        entropy = terms.entropy if with_entropy else torch.zeros_like(terms.logps)
        return torch.stack([terms.logps, entropy], dim=-1)


def fuse_lm_head(module: torch.nn.Module) -> FusedLMHead:
    """Turn `module`'s output embedding (an ``nn.Linear``) into a `FusedLMHead`, in place.

    The parameters stay the same objects (tied embeddings stay tied). Raises ``TypeError`` when
    the output embedding is not an ``nn.Linear``, and ``ValueError`` when the model caps its
    logits (``final_logit_softcapping``: the cap follows the lm_head, and the fused loss would
    pass through it).
    """
    cap = getattr(getattr(module, "config", None), "final_logit_softcapping", None)
    if cap is not None:
        raise ValueError(
            f"final_logit_softcapping={cap} is not supported: twinkle fuses the loss into the "
            "lm_head, before the cap. Use final_logit_softcapping=None."
        )
    head = module.get_output_embeddings()
    if type(head) is not torch.nn.Linear and not isinstance(head, FusedLMHead):
        raise TypeError(f"the lm_head is a {type(head).__name__}; twinkle needs an nn.Linear")
    head.__class__ = FusedLMHead
    return head


@contextlib.contextmanager
def loss_mode(
    head: FusedLMHead, labels: torch.Tensor, rows: torch.Tensor | None = None
) -> Iterator[None]:
    """Within the block, `head` returns the CE sum of its input against `labels`.

    `rows`: the labels' `twinkle_fn.losses.supervised_rows`, computed before the forward so that
    the loss needs no device sync mid-step; None has the loss count them itself.
    """
    head._labels, head._rows = labels, rows
    try:
        yield
    finally:
        head._labels, head._rows = None, None


@contextlib.contextmanager
def terms_mode(
    head: FusedLMHead,
    labels: torch.Tensor,
    rows: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> Iterator[None]:
    """Within the block, `head` returns ``[batch, seq, 2]`` float32: the log-probability of each
    of `labels` ``[batch, seq]`` under ``softmax(logits / temperature)`` and (with
    `with_entropy`, else 0) the softmax's entropy; 0 at ignored tokens. `rows` as in
    `loss_mode`."""
    head._terms = (temperature, with_entropy)
    try:
        with loss_mode(head, labels, rows):
            yield
    finally:
        head._terms = None
