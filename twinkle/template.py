"""`Template`: chat trajectories -> features with assistant-only, already-shifted labels.

A thin layer over `twinkle_fn.data.encode_messages` (the tokenizer's own chat template renders
the conversation; the tokens each assistant turn adds are supervised) that adds upstream's
record fields (``attention_mask``, ``position_ids``, ``length``) and truncation strategies.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from twinkle_fn.data import IGNORE_INDEX, encode_messages
from twinkle_fn.models import resolve_model_dir

TRUNCATION = ("raise", "left", "right", "delete")
_UNSUPPORTED_FIELDS = ("tools", "images", "videos", "audios")


def load_tokenizer(model_id: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """The tokenizer saved with model `model_id` (a local directory, ``hf://`` or ``ms://``).

    Raises ``ValueError`` when the directory holds no loadable tokenizer.
    """
    path = resolve_model_dir(model_id)
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"no tokenizer could be loaded from {path} ({e}); save one into the model "
            "directory or pass a tokenizer object to Template"
        ) from e


class Template:
    """Encodes trajectories (``{"messages": [...]}``) with a tokenizer's chat template.

    `model_id` is a model directory / hub id to load the tokenizer from, or a tokenizer object.
    `max_length` bounds a sample's tokens; longer ones are handled by `truncation_strategy`:
    ``'raise'`` (ValueError), ``'right'`` (keep the first `max_length`), ``'left'`` (keep the
    last), ``'delete'`` (`encode` returns None; `batch_encode` drops the sample).
    `default_system` is prepended as a system message when a conversation has none. Raises
    ``ValueError`` for ``use_chat_template=False`` (plain-text encoding is
    `twinkle_fn.data.encode_text`), an unknown strategy or a bad `max_length`.
    """

    def __init__(
        self,
        model_id: str | os.PathLike[str] | PreTrainedTokenizerBase,
        use_chat_template: bool = True,
        max_length: int | None = 8192,
        truncation_strategy: str = "raise",
        default_system: str | None = None,
    ) -> None:
        if not use_chat_template:
            raise ValueError(
                "use_chat_template=False is not supported; trajectories are rendered with the "
                "tokenizer's chat template"
            )
        if truncation_strategy not in TRUNCATION:
            raise ValueError(
                f"truncation_strategy must be one of {', '.join(TRUNCATION)}, "
                f"got {truncation_strategy!r}"
            )
        if max_length is not None and (
            isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1
        ):
            raise ValueError(f"max_length must be a positive int or None, got {max_length!r}")
        if isinstance(model_id, PreTrainedTokenizerBase):
            self.tokenizer = model_id
            self.model_id = getattr(model_id, "name_or_path", None)
        else:
            self.tokenizer = load_tokenizer(model_id)
            self.model_id = os.fspath(model_id)
        self.max_length = max_length
        self.truncation_strategy = truncation_strategy
        self.default_system = default_system

    @property
    def processor(self) -> PreTrainedTokenizerBase:
        """Upstream's name for the tokenizer (an ``AutoProcessor`` for multimodal models)."""
        return self.tokenizer

    @property
    def pad_token_id(self) -> int:
        """The id right padding uses: the tokenizer's pad token, else EOS, else 0."""
        for tid in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id):
            if tid is not None:
                return tid
        return 0

    def encode(
        self, trajectory: Mapping[str, Any], add_generation_prompt: bool = False
    ) -> dict[str, Any] | None:
        """One trajectory as a feature, or None when ``truncation_strategy='delete'`` drops it.

        Returns ``input_ids``, ``labels`` (shifted; -100 outside assistant turns),
        ``attention_mask`` (ones), ``position_ids`` (0..n-1), each a list of n ints, and
        ``length`` = n. Raises ``ValueError`` for tools or multimodal fields, for
        ``add_generation_prompt=True`` (prompts for sampling; no sampler in this build), for a
        sample over `max_length` under ``'raise'``, and for malformed messages.
        """
        if add_generation_prompt:
            raise ValueError(
                "add_generation_prompt=True builds sampling prompts, and this build has no "
                "sampler; encode training trajectories with add_generation_prompt=False"
            )
        messages = self._messages(trajectory)
        feature = encode_messages(self.tokenizer, messages)
        ids, labels = feature["input_ids"], feature["labels"]
        if self.max_length is not None and len(ids) > self.max_length:
            keep = self._truncate(len(ids))
            if keep is None:
                return None
            ids, labels = ids[keep], labels[keep]
            if keep.start == 0:  # as encode_messages truncates: nothing past the window is a target
                labels = [*labels[:-1], IGNORE_INDEX]
        n = len(ids)
        return {
            "input_ids": ids,
            "labels": labels,
            "attention_mask": [1] * n,
            "position_ids": list(range(n)),
            "length": n,
        }

    def batch_encode(
        self, trajectories: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False
    ) -> list[dict[str, Any]]:
        """`encode` each trajectory, dropping those the truncation strategy deletes."""
        encoded = (self.encode(t, add_generation_prompt) for t in trajectories)
        return [f for f in encoded if f is not None]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of `token_ids`."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def _messages(self, trajectory: Mapping[str, Any]) -> list[Mapping[str, Any]]:
        if not isinstance(trajectory, Mapping) or "messages" not in trajectory:
            got = list(trajectory) if isinstance(trajectory, Mapping) else type(trajectory).__name__
            raise ValueError(
                f"a trajectory is a dict with 'messages' (a list of {{'role', 'content'}}); got {got}"
            )
        for field in _UNSUPPORTED_FIELDS:
            if trajectory.get(field):
                raise ValueError(
                    f"trajectory field {field!r} is not supported by this build (text chats only)"
                )
        messages = list(trajectory["messages"])
        if self.default_system is not None and (
            not messages or messages[0].get("role") != "system"
        ):
            messages.insert(0, {"role": "system", "content": self.default_system})
        return messages

    def _truncate(self, n: int) -> slice | None:
        assert self.max_length is not None
        if self.truncation_strategy == "raise":
            raise ValueError(
                f"a sample has {n} tokens > max_length={self.max_length}; raise max_length or "
                "use truncation_strategy='right', 'left' or 'delete'"
            )
        if self.truncation_strategy == "delete":
            return None
        if self.truncation_strategy == "right":
            return slice(0, self.max_length)
        return slice(n - self.max_length, n)


class Qwen3_5Template(Template):
    """Upstream's Qwen3.5 template, by name (``--template-cls Qwen3_5Template``): for text
    conversations it is `Template` (the tokenizer's chat template renders Qwen3.5's turns);
    upstream's vision inputs (``images``, ``videos``) are refused as `Template` refuses them
    (this build is text-only)."""


# upstream's template class names -> this build's classes
TEMPLATES: dict[str, type[Template]] = {"Template": Template, "Qwen3_5Template": Qwen3_5Template}
