"""Upstream Twinkle's data records: `ModelOutput` (what a model call returns)."""

from __future__ import annotations

from typing import Any


class ModelOutput(dict):
    """A dict of a model call's results, also readable as attributes (``out.loss``).

    Keys as upstream: ``loss`` (float, token mean), ``logps`` (``[n_seq, max_len]`` log-prob of
    each label, 0 where the label is ignored), ``logits`` (``[batch, seq, vocab]``, only when
    asked for), ``num_tokens`` (int, supervised tokens), ``grad_norm`` (float, after a step).
    """

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(
                f"ModelOutput has no {name!r}; it holds {', '.join(self) or 'nothing'}"
            ) from None
