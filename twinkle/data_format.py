"""Upstream Twinkle's data records: chat `Message` / `Trajectory` rows and `ModelOutput`.

`Message`, `ToolCall`, `Tool` and `Trajectory` are ``TypedDict`` s as upstream: plain dicts at
run time, so rows built with them are what `Template.encode` and `Dataset` already take.
``Trajectory.user_data`` holds ``(key, json string)`` pairs; `pack_value` / `user_data_get`
write and read them.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypedDict


class FunctionCall(TypedDict, total=False):
    """The ``function`` part of a tool call: its name and arguments (a dict or JSON string)."""

    name: str
    arguments: str | dict[str, Any]


class ToolCall(TypedDict, total=False):
    """One tool invocation of an assistant message (OpenAI's shape)."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class FunctionSpec(TypedDict, total=False):
    """The ``function`` part of a tool definition."""

    name: str
    description: str
    parameters: str | dict[str, Any]


class Tool(TypedDict, total=False):
    """A tool advertised to the model (OpenAI's shape)."""

    type: Literal["function"]
    function: FunctionSpec


class Message(TypedDict, total=False):
    """One turn of a chat: ``{"role": ..., "content": ...}`` plus optional tool fields."""

    role: Literal["system", "user", "assistant", "tool"]
    type: str
    content: str | list[dict[str, str]]
    tool_calls: list[ToolCall]
    tool_call_id: str
    reasoning_content: str


class Trajectory(TypedDict, total=False):
    """A chat sample: ``messages`` plus optional tools, media, prompt and ``user_data``."""

    messages: list[Message]
    tools: list[Tool]
    user_data: list[tuple[str, str]]
    images: list[Any] | None
    videos: list[Any] | None
    audios: list[Any] | None
    prompt: str | None


def pack_value(value: Any) -> str:
    """`value` as the JSON string a ``user_data`` entry stores (non-JSON values via ``str``)."""
    return json.dumps(value, ensure_ascii=False, default=str)


def user_data_get(items: Any, key: str, default: Any = None) -> Any:
    """The first ``user_data`` value stored under `key`, JSON-decoded when it is JSON.

    Returns `default` when `items` is not a list or holds no such key; a string that is not
    JSON comes back as it is.
    """
    if not isinstance(items, list):
        return default
    for entry in items:
        if isinstance(entry, list | tuple) and len(entry) == 2 and entry[0] == key:
            value = entry[1]
            if not isinstance(value, str):
                return value
            try:
                return json.loads(value)
            except ValueError:
                return value
    return default


class ModelOutput(dict):
    """A dict of a model call's results, also readable as attributes (``out.loss``).

    Keys as upstream: ``loss`` (float, token mean), ``logps`` (``[n_seq, max_len]`` log-prob of
    each label, 0 where the label is ignored), ``logits`` (``[batch, seq, vocab]``, only when
    asked for), ``values`` (``[n_seq, max_len]`` a value model's per-token values, laid out as
    ``logps``), ``num_tokens`` (int, supervised tokens), ``grad_norm`` (float, after a step).
    """

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(
                f"ModelOutput has no {name!r}; it holds {', '.join(self) or 'nothing'}"
            ) from None
