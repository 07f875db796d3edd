"""A script argument's value as its field's type: `convert` (checked) and `auto` (``extra``).

Values come as strings from argv or the environment, or typed from YAML; `convert` takes a
field's type hint (``int``, ``float | None``, ``list[str] | None``, a ``Literal`` of choices...)
and raises ``ValueError`` naming the flag, the value and what it takes.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal


def convert(hint: Any, value: Any, where: str) -> Any:
    """`value` (a string from argv or the environment, or a YAML value) as type `hint`.
    Raises ``ValueError`` naming `where`, the value and the type or choices it takes."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
        if type(None) in options:
            return None
        raise ValueError(f"{where}: {value!r} is not allowed here (it needs a value)")
    kind = next(t for t in options if t is not type(None))
    origin = typing.get_origin(kind) or kind
    if origin is Literal:
        choices = typing.get_args(kind)
        if value not in choices:
            raise ValueError(f"{where}: {value!r} is not one of {', '.join(map(repr, choices))}")
        return value
    text = value.strip() if isinstance(value, str) else None
    try:
        if origin is bool:
            if isinstance(value, bool):
                return value
            truth = {"true": True, "yes": True, "on": True, "1": True}
            truth.update({"false": False, "no": False, "off": False, "0": False})
            return truth[(text or "").lower()]
        if origin is int and not isinstance(value, bool):
            number = float(text) if text is not None else value
            if number != int(number):
                raise ValueError
            return int(number)
        if origin is float and not isinstance(value, bool):
            return float(text if text is not None else value)
        if origin is list:
            items = value if isinstance(value, list) else text.split(",")
            return [str(v).strip() for v in items if str(v).strip()]
        if origin is str:
            return str(value)
    except (KeyError, TypeError, ValueError, AttributeError):
        pass
    name = getattr(kind, "__name__", str(kind))
    raise ValueError(f"{where}: {value!r} is not a {name}")


def auto(value: Any) -> Any:
    """An ``extra`` value from argv: a bool, int or float where it reads as one, else as is."""
    if not isinstance(value, str):
        return value
    low = value.lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value
