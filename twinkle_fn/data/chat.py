"""Encoding chat conversations and plain text into features with shifted labels.

Labels are computed on unshifted positions (a token's own id where it is supervised, -100
elsewhere), truncated with the ids, then shifted left by one so that ``labels[t]`` is the target
for position ``t`` -- the convention the losses consume.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from twinkle_fn.data.collate import IGNORE_INDEX, Feature

ROLES = ("system", "user", "assistant")


def validate_messages(messages: Any, where: str = "messages") -> None:
    """Check that `messages` is a non-empty list of ``{"role": ..., "content": str}`` dicts.

    Roles are ``"system"``, ``"user"`` or ``"assistant"``; other keys are ignored.

    Raises:
        TypeError: `messages` is not a list, a message is not a dict, or a content is not a str.
        ValueError: the list is empty, a field is missing, or a role is unknown.
    """
    if not isinstance(messages, list):
        raise TypeError(f"{where} must be a list of messages, got {type(messages).__name__}")
    if not messages:
        raise ValueError(f"{where} is empty: a conversation needs at least one message")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"{where}[{i}] must be a dict, got {type(message).__name__}")
        for field in ("role", "content"):
            if field not in message:
                raise ValueError(f"{where}[{i}] has no {field!r} field")
        if message["role"] not in ROLES:
            raise ValueError(
                f"{where}[{i}]['role'] must be one of {', '.join(ROLES)}; got {message['role']!r}"
            )
        if not isinstance(message["content"], str):
            raise TypeError(
                f"{where}[{i}]['content'] must be a str, got {type(message['content']).__name__}"
            )


def _check_max_length(max_length: int | None) -> None:
    if max_length is not None and (
        isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1
    ):
        raise ValueError(f"max_length must be a positive int or None, got {max_length!r}")


def _to_feature(input_ids: list[int], raw_labels: list[int], max_length: int | None) -> Feature:
    input_ids, raw_labels = input_ids[:max_length], raw_labels[:max_length]
    return {"input_ids": input_ids, "labels": [*raw_labels[1:], IGNORE_INDEX]}


def _render_ids(
    tokenizer: Any, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool
) -> list[int]:
    text = tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
    )
    # The rendered text already holds every special token the template wants (BOS included).
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_messages(
    tokenizer: Any, messages: Sequence[Mapping[str, str]], max_length: int | None = None
) -> Feature:
    """Encode a conversation with the tokenizer's chat template, supervising assistant turns only.

    For assistant turn ``i`` the supervised span is what rendering ``messages[:i + 1]`` adds to
    rendering ``messages[:i]`` with the generation prompt: the assistant content plus whatever the
    template closes the turn with (e.g. ``<|im_end|>\\n``). Works for any Hugging Face tokenizer
    with a prefix-stable ``chat_template``. Truncation keeps the first `max_length` tokens.

    Returns:
        ``{"input_ids": [seq], "labels": [seq]}`` with labels shifted (``labels[t]`` is the target
        of position ``t``; -100 elsewhere and at the last position).

    Raises:
        TypeError/ValueError: malformed messages (see `validate_messages`), a bad `max_length`,
            a tokenizer without a chat template, or a template that is not prefix-stable.
    """
    validate_messages(messages)
    _check_max_length(max_length)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{type(tokenizer).__name__} has no chat_template; set tokenizer.chat_template or "
            "encode plain text with encode_text"
        )
    input_ids = _render_ids(tokenizer, messages, add_generation_prompt=False)
    raw_labels = [IGNORE_INDEX] * len(input_ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render_ids(tokenizer, messages[:i], add_generation_prompt=True)
        turn = _render_ids(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if turn[: len(prompt)] != prompt or input_ids[: len(turn)] != turn:
            raise ValueError(
                f"chat template is not prefix-stable at messages[{i}] (assistant): the tokens of "
                f"messages[:{i}] with the generation prompt are not a prefix of those of "
                f"messages[:{i + 1}], or those are not a prefix of the whole conversation; the "
                "template rewrites earlier turns or tokens merge across the turn boundary. Use a "
                "template that renders earlier turns identically."
            )
        raw_labels[len(prompt) : len(turn)] = turn[len(prompt) :]
    return _to_feature(input_ids, raw_labels, max_length)


def encode_text(tokenizer: Any, text: str, max_length: int | None = None) -> Feature:
    """Encode plain text for language modelling: every token is supervised, and EOS is appended.

    The tokenizer's own special tokens (e.g. a BOS) are added; EOS is appended unless the
    tokenizer already ends the sequence with it. Truncation keeps the first `max_length` tokens.

    Returns:
        ``{"input_ids": [seq], "labels": [seq]}`` with labels shifted (the last is -100).

    Raises:
        TypeError: `text` is not a str.
        ValueError: the tokenizer has no EOS token, or a bad `max_length`.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    _check_max_length(max_length)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"{type(tokenizer).__name__} has no eos_token; set tokenizer.eos_token")
    input_ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    if not input_ids or input_ids[-1] != eos:
        input_ids.append(eos)
    return _to_feature(input_ids, list(input_ids), max_length)
