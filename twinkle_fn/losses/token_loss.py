"""The loss seam: a loss is a pure function of per-token log-probabilities and batch fields.

A backend computes, for every token of the part of a batch it runs at once, ``log p(label)``
under the model (and, when the loss asks, the softmax's entropy), then calls the loss with those
and the batch fields the loss reads. The loss returns a token sum and a token count
(`LossOutput`); ``tf.step`` divides the gradients of the sums of every micro-batch and data rank
once by the counts summed likewise, so normalisation stays exact for any loss.

A loss is any callable ``loss(inputs: TokenInputs) -> LossOutput`` with two attributes (the
`TokenLoss` protocol; `token_loss` wraps a plain function):

- ``fields``: the names of the batch fields it reads (e.g. ``("advantages",)``). Each is a
  tensor shaped like ``labels`` (``[B, T]`` padded, ``[1, T]`` packed), aligned with the
  already-shifted labels; `twinkle_fn.data` collation builds them from per-token lists or
  per-sample numbers and carries them through packing and splitting.
- ``needs``: the per-token terms beyond ``logps`` it needs, a subset of `TERMS`: ``"entropy"``
  (of the softmax over the vocabulary) and ``"values"`` (the per-token outputs of a value head).
  A model with a value head (``tf.models.from_pretrained(dir, head="value")``, a critic) gives
  ``values`` and no log-probabilities: it trains exactly the losses that need ``"values"``
  (and nothing else), and those train nothing else (`check_head`).

What a loss sees. The backend may hand it any part of the batch (a micro-batch of rows or packed
samples; under megatron's context parallelism each rank's two chunks of every sequence), with
padding the backend added (label -100, fields 0). So ``loss_sum`` must be a sum over tokens of
terms that depend on that token's inputs only, zero where the label is -100; the sums of the
parts then add up to the batch's. Per-sequence quantities (a GRPO sequence mean, say) are
per-token fields the data carries (a per-sample number is broadcast to its tokens).

A loss that is not a sum of per-token terms (DPO's, a function of per-sequence sums) is a
*sequence loss*: it has ``fields``, ``check(batch)`` (raises before any compute) and
``linearise(batch, logps) -> (token_loss, batch)``; ``tf.fwd_bwd`` runs a forward without
gradients, hands its log-probabilities to ``linearise`` and trains the `TokenLoss` it returns,
whose gradient is the sequence loss's (`twinkle_fn.losses.preference`).

The default cross entropy is not a `TokenLoss`: ``tf.fwd_bwd(..., loss=None)`` keeps each
backend's fused linear + cross-entropy kernel, which never builds the ``[tokens, vocab]`` logits.
A `TokenLoss` runs on the logits in float32, so it costs what ``tf.token_logps`` costs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor

from twinkle_fn.losses.cross_entropy import LossOutput, accumulation_dtype, token_logps

IGNORE_INDEX = -100
TERMS = frozenset({"entropy", "values"})
"""The per-token terms a loss may need besides ``logps``."""


@dataclass(frozen=True)
class TokenInputs:
    """What a backend hands a `TokenLoss`: per-token tensors, all shaped like ``labels``.

    ``logps``: ``[B, T]`` float32 (float64 for a float64 model), ``log p(label)``,
    differentiable, 0 where the label is -100. ``labels``: ``[B, T]`` int64, already shifted,
    -100 where not supervised (prompt, padding). ``fields``: the batch fields the loss declared,
    by name, each ``[B, T]`` (0 on padding). ``entropy``: ``[B, T]`` float32, differentiable,
    the entropy of the softmax over the vocabulary at each token, 0 where the label is -100;
    set only when the loss needs it. ``values``: ``[B, T]`` float32 (float64 for a float64
    model), differentiable, a value head's estimate at each token (read from the hidden state
    that predicts its label), 0 where the label is -100; set on a value model only, whose
    ``logps`` are then None.
    """

    logps: Tensor | None
    labels: Tensor
    fields: Mapping[str, Tensor] = field(default_factory=dict)
    entropy: Tensor | None = None
    values: Tensor | None = None

    @property
    def mask(self) -> Tensor:
        """``[B, T]`` bool: the supervised tokens (label != -100)."""
        return self.labels != IGNORE_INDEX


class TokenLoss(Protocol):
    """A loss over per-token log-probabilities (see the module docstring)."""

    fields: tuple[str, ...]
    needs: frozenset[str]

    def __call__(self, inputs: TokenInputs) -> LossOutput:
        """The token-summed loss of `inputs` and the number of tokens it counts."""
        ...


class SequenceLoss(Protocol):
    """A loss of per-sequence sums that ``tf.fwd_bwd`` linearises (see the module docstring)."""

    fields: tuple[str, ...]

    def check(self, batch: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` when `batch` cannot feed the loss (before any compute)."""
        ...

    def linearise(
        self, batch: Mapping[str, Any], logps: Tensor
    ) -> tuple[TokenLoss, dict[str, Any]]:
        """A `TokenLoss` with this loss's gradient and value at the weights that gave `logps`
        ``[B, T]``, and `batch` with the fields it reads."""
        ...


@dataclass(frozen=True)
class FunctionLoss:
    """A `TokenLoss` made of a plain function (built by `token_loss`)."""

    fn: Callable[[TokenInputs], LossOutput]
    fields: tuple[str, ...] = ()
    needs: frozenset[str] = frozenset()

    def __call__(self, inputs: TokenInputs) -> LossOutput:
        """``fn(inputs)``."""
        return self.fn(inputs)


def token_loss(
    fn: Callable[[TokenInputs], LossOutput],
    *,
    fields: Iterable[str] = (),
    needs: Iterable[str] = (),
) -> FunctionLoss:
    """`fn` as a `TokenLoss` that reads batch `fields` and needs the per-token terms `needs`.

    Raises ``TypeError`` for a `fn` that is not callable or names that are not strings,
    ``ValueError`` for a term outside `TERMS`. (A loss that needs ``"values"`` trains value
    models only: `check_head`.)
    """
    if not callable(fn):
        raise TypeError(f"a loss is a callable of TokenInputs, got {fn!r}")
    loss = FunctionLoss(fn, _names(fields, "fields"), frozenset(_names(needs, "needs")))
    _known_needs(loss)
    return loss


@dataclass(frozen=True)
class PolicyGradient:
    """``sum over supervised tokens of -(advantages * logps) - entropy_coef * entropy``.

    The REINFORCE / vanilla policy-gradient loss with an optional entropy bonus; it counts the
    supervised tokens, so ``tf.step`` applies the token mean. Reads the batch field
    ``advantages`` (per token, or per sample broadcast at collation); needs ``entropy`` only
    when ``entropy_coef`` is not 0.
    """

    entropy_coef: float = 0.0
    fields: ClassVar[tuple[str, ...]] = ("advantages",)

    @property
    def needs(self) -> frozenset[str]:
        """``{"entropy"}`` when the entropy bonus is on, else nothing."""
        return frozenset({"entropy"}) if self.entropy_coef else frozenset()

    def __call__(self, inputs: TokenInputs) -> LossOutput:
        """`LossOutput` of the loss above over `inputs` (advantages are cast to logps' dtype)."""
        mask = inputs.mask
        advantages = inputs.fields["advantages"].to(inputs.logps.dtype)
        terms = -(advantages * inputs.logps)  # [B, T]
        if self.entropy_coef:
            terms = terms - self.entropy_coef * inputs.entropy
        # where, not a product: a non-finite value on an ignored token must not leak in
        return LossOutput(torch.where(mask, terms, 0.0).sum(), mask.sum())


def policy_gradient(entropy_coef: float = 0.0) -> PolicyGradient:
    """The `PolicyGradient` loss. Raises ``ValueError`` for an `entropy_coef` that is not a
    finite real number."""
    if (
        isinstance(entropy_coef, bool)
        or not isinstance(entropy_coef, int | float)
        or not math.isfinite(entropy_coef)
    ):
        raise ValueError(f"entropy_coef must be a finite number, got {entropy_coef!r}")
    return PolicyGradient(float(entropy_coef))


def is_sequence_loss(loss: Any) -> bool:
    """Whether `loss` is a sequence loss (module docstring): it has ``linearise``."""
    return callable(getattr(loss, "linearise", None))


def check_loss(loss: Any, batch: Mapping[str, Any], *, head: str = "lm") -> None:
    """Raise, before any compute, when `loss` is not a `TokenLoss` or sequence loss that
    `batch` and a model with `head` can feed.

    `batch` is a padded or packed batch (``labels`` ``[B, T]``); `head` is the model's
    (`twinkle_fn.models.model.HEADS`). Raises ``TypeError`` when `loss` is neither (a callable
    with ``fields`` / ``needs`` of strings, or an object with ``fields``, ``check`` and
    ``linearise``); ``ValueError`` when it needs a term outside `TERMS`, when `check_head`
    refuses it for `head`, when a sequence loss's ``check`` refuses the batch, or when it reads
    a field the batch lacks or that is not a tensor shaped like ``labels``.
    """
    sequence = is_sequence_loss(loss) and callable(getattr(loss, "check", None))
    token = callable(loss) and hasattr(loss, "needs")
    if not hasattr(loss, "fields") or not (sequence or token):
        raise TypeError(
            f"loss must be a TokenLoss (a callable with `fields` and `needs`, see "
            f"twinkle_fn.losses.token_loss), a sequence loss (`fields`, `check`, `linearise`, "
            f"e.g. twinkle_fn.losses.dpo_loss), or None for the default cross entropy; got "
            f"{loss!r}"
        )
    _names(loss.fields, "fields")
    check_head(loss, head)
    labels = batch.get("labels")
    if not isinstance(labels, Tensor):
        raise ValueError("batch has no 'labels' tensor; build it with pad_collate or pack")
    if sequence:
        loss.check(batch)
    for name in loss.fields:
        if name not in batch:
            have = sorted(k for k in batch if k not in ("input_ids", "labels"))
            raise ValueError(
                f"the loss {_describe(loss)} reads batch field {name!r}, which the batch lacks "
                f"(it has {have}); give every feature {name!r} (a list per token or one number "
                "per sample) before collating"
            )
        value = batch[name]
        if not isinstance(value, Tensor) or value.shape != labels.shape:
            got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(
                f"batch field {name!r} must be a tensor shaped like labels "
                f"{tuple(labels.shape)}, got {got}"
            )


def check_head(loss: Any, head: str) -> None:
    """Raise ``ValueError``, before any compute, when a model whose head is `head` cannot feed
    `loss` (None: the default cross entropy).

    A value model (`head` ``"value"``) gives per-token values only, so it takes a `TokenLoss`
    that needs ``"values"`` and no other term; any other model gives log-probabilities (and
    entropy), so it takes every loss but those. Raises also for a term outside `TERMS`.
    """
    token = loss is not None and not is_sequence_loss(loss)
    needs = _known_needs(loss) if token else frozenset()
    name = "the default cross entropy" if loss is None else f"the loss {_describe(loss)}"
    if head == "value" and needs != {"values"}:
        raise ValueError(
            f"this model has a value head: it gives per-token values only (no log-probabilities "
            f"or entropy), so {name} cannot train it; train a critic with a value loss "
            "(loss=tf.losses.value_loss()), or build the model without head='value'"
        )
    if head != "value" and "values" in needs:
        raise ValueError(
            f"{name} needs 'values' (per-token estimates of a value head), but this model has "
            "no value head; build the critic with tf.models.from_pretrained(dir, head='value') "
            "(or from_hf_config(config, head='value'))"
        )


def apply_loss(loss: TokenLoss, inputs: TokenInputs) -> LossOutput:
    """``loss(inputs)``, checked: raises ``TypeError`` unless it is a `LossOutput` of two 0-d
    tensors."""
    out = loss(inputs)
    if not (
        isinstance(out, LossOutput) and all(isinstance(t, Tensor) and t.ndim == 0 for t in out)
    ):
        raise TypeError(
            f"the loss {_describe(loss)} returned {out!r}; a loss returns "
            "LossOutput(loss_sum, num_tokens), both 0-d tensors"
        )
    return out


def token_entropy(logits: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Per-token entropy of ``softmax(logits)``: 0 where the label is `ignore_index`.

    `logits` ``[..., vocab]`` (any float dtype; the softmax runs in float32, float64 stays
    float64), `labels` ``[...]``. Returns ``[...]``, differentiable w.r.t. `logits`.
    """
    logp = torch.log_softmax(logits.to(accumulation_dtype(logits.dtype)), dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return entropy.masked_fill(labels == ignore_index, 0.0)


def inputs_from_logits(
    logits: Tensor, labels: Tensor, fields: Mapping[str, Tensor], needs: frozenset[str]
) -> TokenInputs:
    """`TokenInputs` from whole-vocabulary `logits` ``[B, T, vocab]`` and `labels` ``[B, T]``:
    ``logps`` (and ``entropy`` when `needs` it) in float32. Raises as
    `twinkle_fn.losses.token_logps` does."""
    return TokenInputs(
        logps=token_logps(logits, labels, IGNORE_INDEX),
        labels=labels,
        fields=dict(fields),
        entropy=token_entropy(logits, labels) if "entropy" in needs else None,
    )


def _names(names: Any, what: str) -> tuple[str, ...]:
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise TypeError(f"a loss's {what} must be a collection of names, got {names!r}")
    out = tuple(names)
    if not all(isinstance(n, str) for n in out):
        raise TypeError(f"a loss's {what} must be strings, got {out!r}")
    return out


def _known_needs(loss: Any) -> frozenset[str]:
    """`loss`'s ``needs``; raises ``ValueError`` for a term outside `TERMS`."""
    needs = frozenset(_names(loss.needs, "needs"))
    if needs - TERMS:
        raise ValueError(
            f"the loss {_describe(loss)} needs {sorted(needs - TERMS)}, which no backend "
            f"computes; a loss may need {sorted(TERMS)}"
        )
    return needs


def _describe(loss: Any) -> str:
    if isinstance(loss, FunctionLoss):
        return getattr(loss.fn, "__qualname__", repr(loss.fn))
    return repr(loss)
