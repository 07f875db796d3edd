"""A built-in arithmetic chat dataset for the offline `twinkle train` demo.

Questions like ``"What is 12 + 34?"`` with the exact answer; small enough that a tiny model
visibly learns it in minutes on CPU, and held-out questions measure more than memorisation.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

_OPS = ("+", "-", "*")


def _question(a: int, op: str, b: int) -> str:
    return f"What is {a} {op} {b}?"


def arithmetic_dataset(num_samples: int, seed: int = 0, max_operand: int = 99) -> list[dict]:
    """`num_samples` chat rows asking for a sum, difference or product of two operands.

    Operands are drawn uniformly from ``0..max_operand``; a subtraction puts the larger operand
    first so answers are never negative. The rows are a pure function of the arguments
    (``random.Random(seed)``). Each row is ``{"messages": [{"role": "user", "content": "What is
    12 + 34?"}, {"role": "assistant", "content": "46"}]}``; questions may repeat.

    Raises:
        ValueError: a negative `num_samples` or `max_operand`.
    """
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    if max_operand < 0:
        raise ValueError(f"max_operand must be >= 0, got {max_operand}")
    rng = random.Random(seed)
    rows = []
    for _ in range(num_samples):
        op = rng.choice(_OPS)
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        if op == "-" and a < b:
            a, b = b, a
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": _question(a, op, b)},
                    {"role": "assistant", "content": str(answer)},
                ]
            }
        )
    return rows


def _prompt_key(row: Mapping[str, Any]) -> str:
    # The question a row asks: every non-assistant turn, or the text itself for text rows.
    if "messages" in row:
        return repr(
            [(m["role"], m["content"]) for m in row["messages"] if m["role"] != "assistant"]
        )
    return repr(row["text"])


def train_heldout_split(
    rows: Sequence[Mapping[str, Any]], heldout_fraction: float = 0.1, seed: int = 0
) -> tuple[list, list]:
    """Split `rows` into ``(train, heldout)`` by question, so no held-out question is in train.

    Rows with the same prompt (all non-assistant turns, or the ``text``) go to the same side.
    About ``heldout_fraction`` of the distinct prompts, chosen by ``random.Random(seed)``, are
    held out (at least one, and at least one is kept for training). Both sides keep the input
    order; together they are a partition of `rows`.

    Raises:
        ValueError: `heldout_fraction` outside (0, 1), or fewer than two distinct prompts.
    """
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    keys = [_prompt_key(row) for row in rows]
    distinct = sorted(set(keys))
    if len(distinct) < 2:
        raise ValueError(
            f"need at least two distinct questions to split, got {len(distinct)}; add rows"
        )
    random.Random(seed).shuffle(distinct)
    n_heldout = min(max(1, round(heldout_fraction * len(distinct))), len(distinct) - 1)
    heldout_keys = set(distinct[:n_heldout])
    train = [row for row, key in zip(rows, keys, strict=True) if key not in heldout_keys]
    heldout = [row for row, key in zip(rows, keys, strict=True) if key in heldout_keys]
    return train, heldout
