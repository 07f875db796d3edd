"""Where a dataset's rows come from (`DatasetMeta`) and reading them: rows in memory, local
``.jsonl`` / ``.json`` / ``.csv`` / ``.txt`` files or directories of them, or a hub id through
`HubOperation`; each row with where it came from (``file:line``), for the errors that name it."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import re
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from twinkle.dataset._rows import Row, _rows_of
from twinkle.hub import HubOperation
from twinkle_fn.data import read_text

FILE_TYPES = (".jsonl", ".json", ".csv", ".txt")


@dataclasses.dataclass
class DatasetMeta:
    """Where a dataset's rows come from.

    `data`: rows in memory (a list of dicts, a dict of columns, a generator function, or an HF
    ``datasets.Dataset``). Otherwise `dataset_id`: a local ``.jsonl``, ``.json``, ``.csv`` or
    ``.txt`` file or a directory of them, or (with the ``datasets`` package) a hub id taken
    with `subset_name` and `split`. `data_slice`: the row indices to keep, applied after
    loading; indices past the end wrap around, as upstream. Raises ``ValueError`` when neither
    source is given or `data_slice` is not iterable.
    """

    dataset_id: str = ""
    subset_name: str = "default"
    split: str = "train"
    data_slice: Iterable[int] | None = None
    data: Any = None

    def __post_init__(self) -> None:
        self._uid = uuid.uuid4().hex[:8]
        if self.data_slice is not None and not isinstance(self.data_slice, Iterable):
            raise ValueError("data_slice must be an iterable")
        if not self.dataset_id and self.data is None:
            raise ValueError(
                "DatasetMeta needs data=<rows> or dataset_id=<a local file, directory or hub id>"
            )

    def get_id(self) -> str:
        """A key naming this source (unique per instance for in-memory data)."""
        if self.data is not None:
            return f"__memory_{self._uid}__:{self.subset_name}:{self.split}"
        name = self.dataset_id.replace(os.sep, "_").replace(".", "_")
        return f"{name}:{self.subset_name}:{self.split}"


def _load(meta: DatasetMeta, load_kwargs: Mapping[str, Any]) -> tuple[list[Row], list[str]]:
    """The rows of `meta` and where each came from (``file:line``, ``data[i]``, ``id[i]``)."""
    if not isinstance(meta, DatasetMeta):
        raise TypeError(f"dataset_meta must be a DatasetMeta, got {type(meta).__name__}")
    if meta.data is not None:
        rows = _rows(meta.data)
        origins = [f"DatasetMeta.data[{i}]" for i in range(len(rows))]
    else:
        rows, origins = _from_id(meta, load_kwargs)
    if meta.data_slice is not None and rows:
        picked = [i % len(rows) for i in meta.data_slice]
        rows, origins = [rows[i] for i in picked], [origins[i] for i in picked]
    return rows, origins


def _rows(data: Any) -> list[Row]:
    if isinstance(data, Mapping):
        return _rows_of(dict(data), "DatasetMeta.data (a dict of columns)")
    if callable(data):
        data = data()
    if not isinstance(data, Iterable):
        raise TypeError(
            f"DatasetMeta.data must be rows, columns or a generator function, got "
            f"{type(data).__name__}"
        )
    rows = [dict(r) if isinstance(r, Mapping) else r for r in data]
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise TypeError(f"DatasetMeta.data[{i}] must be a dict, got {type(row).__name__}")
    return rows


def _from_id(meta: DatasetMeta, load_kwargs: Mapping[str, Any]) -> tuple[list[Row], list[str]]:
    path = Path(os.path.expanduser(meta.dataset_id))
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in FILE_TYPES)
        if not files:
            raise ValueError(f"directory {path} has no {', '.join(FILE_TYPES)} files")
        read = [_read_file(file) for file in files]
        return [r for rows, _ in read for r in rows], [o for _, origins in read for o in origins]
    if path.suffix in FILE_TYPES:
        if not path.is_file():
            raise ValueError(f"dataset file {path} does not exist")
        return _read_file(path)
    loaded = HubOperation.load_dataset(
        meta.dataset_id, meta.subset_name, meta.split, **dict(load_kwargs)
    )
    rows = _rows(loaded)
    return rows, [f"{meta.dataset_id}[{i}]" for i in range(len(rows))]


def _read_file(path: Path) -> tuple[list[Row], list[str]]:
    """The rows of a local file, by extension, as upstream's ``datasets`` loaders read them,
    and where each starts (``file:line``; ``file[i]`` for a JSON document).

    Raises ``ValueError`` naming the file (and line) for bytes that are not UTF-8, invalid
    JSON lines, and a file without rows.
    """
    text = read_text(path)
    if path.suffix == ".csv":
        reader = csv.DictReader(io.StringIO(text, newline=""))
        found = [(dict(row), f"{path}:{reader.line_num}") for row in reader]
        rows, origins = _typed_csv([row for row, _ in found]), [origin for _, origin in found]
    elif path.suffix == ".txt":
        lines = io.StringIO(text, newline=None)
        rows = [{"text": line.rstrip("\n")} for line in lines]
        origins = [f"{path}:{n}" for n in range(1, len(rows) + 1)]
    else:
        rows, origins = _json_rows(text, path)
    if not rows:
        raise ValueError(
            f"dataset file {path} has no rows (it is empty or blank); add rows or leave the "
            "file out"
        )
    return rows, origins


_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|[+-]?(inf|nan)", re.IGNORECASE)


def _typed_csv(rows: list[Row]) -> list[Row]:
    """`rows` of csv strings with each column typed as upstream's loader (pandas, with
    ``na_filter=False``) types it: int when every value is an integer, float when every value
    is a number, else the strings as written (an empty cell keeps its column strings)."""
    for column in rows[0] if rows else ():
        values = [row[column] for row in rows]
        if all(isinstance(v, str) and _INT.fullmatch(v.strip()) for v in values):
            cast: Callable[[str], Any] = int
        elif all(isinstance(v, str) and _FLOAT.fullmatch(v.strip()) for v in values):
            cast = float
        else:
            continue
        for row in rows:
            row[column] = cast(row[column])
    return rows


def _json_rows(text: str, path: Path) -> tuple[list[Row], list[str]]:
    """A ``.json`` file's rows (a list of rows, a dict of columns, or JSON lines), or a
    ``.jsonl`` file's."""
    if path.suffix == ".json":
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None  # not one document: JSON lines, which the json loader also reads
        if isinstance(whole, list):
            rows = _rows(whole)
            return rows, [f"{path}[{i}]" for i in range(len(rows))]
        if isinstance(whole, dict):
            rows = _rows_of(whole, f"{path} (a dict of columns)")
            return rows, [f"{path}[{i}]" for i in range(len(rows))]
    return _json_lines(text, path)


def _json_lines(text: str, path: Path) -> tuple[list[Row], list[str]]:
    rows, origins = [], []
    # split at "\n" only: str.splitlines would also split inside a JSON string at U+2028 etc.
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from e
        if not isinstance(row, dict):
            raise TypeError(
                f'{path}:{lineno}: a row must be a JSON object ({{"field": value, ...}}), got '
                f"{type(row).__name__}"
            )
        rows.append(row)
        origins.append(f"{path}:{lineno}")
    return rows, origins
