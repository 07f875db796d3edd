"""Rows and columns: a `Dataset`'s rows are dicts; `map` functions and dict-of-columns sources
speak columns (``{column: [values]}``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Row = dict[str, Any]


def _columns(rows: list[Row]) -> dict[str, list[Any]]:
    """`rows` as columns; a key some rows lack is None there (as ``datasets`` fills it)."""
    keys = list(dict.fromkeys(k for row in rows for k in row))
    return {k: [row.get(k) for row in rows] for k in keys}


def _rows_of(columns: Any, where: str) -> list[Row]:
    if not isinstance(columns, Mapping):
        raise TypeError(
            f"{where} returned a {type(columns).__name__}, expected a dict of columns "
            "({column: [values]}; map is batched, as upstream's)"
        )
    lengths = {k: len(v) for k, v in columns.items() if isinstance(v, list | tuple)}
    if len(lengths) != len(columns) or len(set(lengths.values())) > 1:
        raise TypeError(f"{where} must return a dict of equal-length lists, got lengths {lengths}")
    count = next(iter(lengths.values()), 0)
    return [{k: columns[k][i] for k in columns} for i in range(count)]
