"""Loading JSON-lines datasets of chat (``messages``) or plain-text (``text``) rows."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from twinkle_fn.data.chat import encode_messages, encode_text, validate_messages
from twinkle_fn.data.collate import Feature


def _check_row(row: Any, where: str) -> None:
    if not isinstance(row, Mapping):
        raise TypeError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    has_messages, has_text = "messages" in row, "text" in row
    if has_messages == has_text:
        raise ValueError(
            f"{where}: a row needs exactly one of 'messages' (a chat) or 'text' (plain text), "
            f"got {'both' if has_messages else 'neither'}"
        )
    if has_messages:
        validate_messages(row["messages"], where=f"{where}: messages")
    elif not isinstance(row["text"], str):
        raise TypeError(f"{where}: 'text' must be a str, got {type(row['text']).__name__}")


def load_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read a JSON-lines file whose rows are chats (``messages``) or plain text (``text``).

    Blank lines are skipped. A chat row has ``"messages": [{"role": "system" | "user" |
    "assistant", "content": str}, ...]``; a text row has ``"text": str``; other keys are kept.

    Raises:
        ValueError/TypeError: naming the file, the 1-based line number and the field, for invalid
            JSON, a row that is not an object, a row with neither or both of ``messages`` and
            ``text``, or a field of the wrong type.
        OSError: the file cannot be read.
    """
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{os.fspath(path)}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from e
            _check_row(row, where)
            rows.append(row)
    return rows


def encode_rows(
    tokenizer: Any, rows: Sequence[Mapping[str, Any]], max_length: int | None = None
) -> list[Feature]:
    """Encode each row with `encode_messages` (``messages`` rows) or `encode_text` (``text`` rows).

    Raises:
        ValueError/TypeError: a malformed row, naming ``rows[i]`` and the field; errors of the
            encoders.
    """
    features = []
    for i, row in enumerate(rows):
        _check_row(row, f"rows[{i}]")
        if "messages" in row:
            features.append(encode_messages(tokenizer, row["messages"], max_length))
        else:
            features.append(encode_text(tokenizer, row["text"], max_length))
    return features
