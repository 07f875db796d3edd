"""Loading JSON-lines datasets of chat (``messages``) or plain-text (``text``) rows."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
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


def read_text(path: str | os.PathLike) -> str:
    """The UTF-8 text of the file at `path` (newlines as written).

    Raises:
        ValueError: the file is not UTF-8 text (e.g. a binary file), naming the file, the 1-based
            line and column of the first bad byte, and the byte.
        OSError: the file cannot be read.
    """
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ValueError(
            f"{os.fspath(path)}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at column "
            f"{column}): a data file must be UTF-8 text; is it a binary or compressed file?"
        ) from None


def load_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read a JSON-lines file whose rows are chats (``messages``) or plain text (``text``).

    Blank lines are skipped. A chat row has ``"messages": [{"role": "system" | "user" |
    "assistant", "content": str}, ...]``; a text row has ``"text": str``; other keys are kept.

    Raises:
        ValueError/TypeError: naming the file, the 1-based line number and the field, for bytes
            that are not UTF-8 (a binary file), invalid JSON, a row that is not an object, a row
            with neither or both of ``messages`` and ``text``, or a field of the wrong type;
            naming the file, for a file without rows (empty or blank).
        OSError: the file cannot be read.
    """
    rows = []
    # split at "\n" only: str.splitlines would also split inside a JSON string at U+2028 etc.
    for lineno, line in enumerate(read_text(path).split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{os.fspath(path)}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from e
        _check_row(row, where)
        rows.append(row)
    if not rows:
        raise ValueError(
            f"{os.fspath(path)}: no rows (the file is empty or blank); write one JSON object "
            "per line, with 'messages' (a chat) or 'text'"
        )
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
