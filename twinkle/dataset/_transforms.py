"""What `Dataset.map`, `filter` and `set_template` are given, made callable, and the batched
map that runs a function over rows in batches of columns."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import twinkle.preprocessor
from twinkle.dataset._rows import Row, _columns, _rows_of
from twinkle.template import TEMPLATES, Template

# datasets.map's default batch size, which upstream keeps
MAP_BATCH_SIZE = 1000


def make_template(template_cls: Template | type | str, **kwargs: Any) -> Template:
    """A `Template` from an instance, a `Template` class, or a class name of
    `twinkle.template.TEMPLATES` (``'Template'``, ``'Qwen3_5Template'``) plus `kwargs`.

    Raises ``ValueError`` for any other name or class.
    """
    if isinstance(template_cls, Template):
        return template_cls
    cls = TEMPLATES.get(template_cls) if isinstance(template_cls, str) else template_cls
    if isinstance(cls, type) and issubclass(cls, Template):
        return cls(**kwargs)
    raise ValueError(
        f"unknown template {template_cls!r}; this build has {', '.join(map(repr, TEMPLATES))} "
        "(each renders with the tokenizer's chat template)"
    )


def make_callable(func: Any, base: type, init_args: Mapping[str, Any] | None) -> Callable:
    """A preprocessor or filter from a callable, a class (built with `init_args`) or the name
    of a class in `twinkle.preprocessor` (upstream's ``construct_class``).

    Raises ``ValueError`` for an unknown name and ``TypeError`` for anything not callable.
    """
    if isinstance(func, str):
        found = getattr(twinkle.preprocessor, func, None)
        if not (isinstance(found, type) and issubclass(found, base)):
            raise ValueError(
                f"{func!r} is not a {base.__name__} in twinkle.preprocessor; pass a function, "
                "a class or an instance"
            )
        func = found
    if isinstance(func, type):
        func = func(**(init_args or {}))
    if not callable(func):
        raise TypeError(f"expected a function (or a class to build one), got {func!r}")
    return func


def _map_batched(fn: Callable, rows: list[Row], batch_size: int, remove: set[str]) -> list[Row]:
    out: list[Row] = []
    for start in range(0, len(rows), max(1, batch_size)):
        batch = rows[start : start + max(1, batch_size)]
        result = fn(_columns(batch))
        if result is None:
            out.extend(batch)
            continue
        new = _rows_of(result, f"map: the function (on rows {start}..)")
        if len(new) != len(batch):
            out.extend(new)
            continue
        for old, row in zip(batch, new, strict=True):
            out.append({**{k: v for k, v in old.items() if k not in remove}, **row})
    return out


def _apply_to_row(fn: Callable, row: Row) -> Row:
    """One row through a recorded map: ``preprocess`` for a `Preprocessor`, else a one-row
    batch of columns."""
    if hasattr(fn, "preprocess"):
        return dict(fn.preprocess(row))
    new = _rows_of(fn({k: [v] for k, v in row.items()}), "map: the function")
    if len(new) != 1:
        raise ValueError(f"a LazyDataset map must return one row per row, got {len(new)}")
    return new[0]
