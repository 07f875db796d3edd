"""Upstream Twinkle's row preprocessors: dataset rows -> chat `Trajectory` rows.

A `Preprocessor` is called by `Dataset.map` on a batch in columns (``{column: [values]}``) and
returns columns, as upstream (``datasets.map(batched=True)``); ``preprocess(row)`` converts one
row. A `DataFilter` is called by `Dataset.filter` on one row and returns whether to keep it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from twinkle.data_format import Message, Trajectory

Row = dict[str, Any]
Columns = dict[str, list[Any]]


class Preprocessor:
    """Base of the batch preprocessors; subclasses define ``preprocess(row)``.

    ``__call__`` turns the columns into rows, preprocesses each and returns columns.
    """

    @staticmethod
    def map_col_to_row(rows: Mapping[str, Sequence[Any]] | list[Row]) -> list[Row]:
        """Rows of a column batch (a list of rows is returned as it is)."""
        if isinstance(rows, list):
            return rows
        if not rows:
            return []
        count = len(next(iter(rows.values())))
        return [{key: rows[key][i] for key in rows} for i in range(count)]

    @staticmethod
    def map_row_to_col(rows: list[Row] | Columns, keys: list[str] | None = None) -> Columns:
        """Columns of a list of rows: `keys`, else the first row's keys (a dict passes through)."""
        if isinstance(rows, dict):
            return rows
        if not rows:
            return {k: [] for k in keys} if keys else {}
        return {key: [row[key] for row in rows] for key in keys or rows[0].keys()}

    def preprocess(self, row: Row) -> Row:
        """One row's result; subclasses implement it."""
        raise NotImplementedError(f"{type(self).__name__} does not define preprocess(row)")

    def __call__(self, rows: Mapping[str, Sequence[Any]]) -> Columns:
        return self.map_row_to_col([self.preprocess(row) for row in self.map_col_to_row(rows)])


class DataFilter:
    """Base of row filters: ``__call__(row) -> bool`` (True keeps the row)."""

    def __call__(self, row: Row) -> bool:
        raise NotImplementedError(f"{type(self).__name__} does not define __call__(row)")


def _replace(text: str, name: str, author: str) -> str:
    return text.replace("{{NAME}}", name).replace("{{AUTHOR}}", author)


class SelfCognitionProcessor(Preprocessor):
    """``query``/``response`` rows with ``{{NAME}}``/``{{AUTHOR}}`` placeholders -> a chat.

    The placeholders become `model_name` (default 'twinkle robot') and `model_author`
    (default 'twinkle lab'); the chat starts with the system prompt 'You are a helpful
    assistant.'.
    """

    def __init__(self, model_name: str | None = None, model_author: str | None = None) -> None:
        self.model_name = model_name or "twinkle robot"
        self.model_author = model_author or "twinkle lab"

    def preprocess(self, row: Row) -> Trajectory:
        """The chat of one ``query``/``response`` row."""
        name, author = self.model_name, self.model_author
        return Trajectory(
            messages=[
                Message(role="system", content="You are a helpful assistant."),
                Message(role="user", content=_replace(row["query"], name, author)),
                Message(role="assistant", content=_replace(row["response"], name, author)),
            ]
        )


class AlpacaProcessor(Preprocessor):
    """``instruction``/``input``/``output`` rows -> user (instruction, newline, input) and
    assistant (output) messages."""

    def preprocess(self, row: Row) -> Trajectory:
        """The chat of one Alpaca row (missing fields count as empty)."""
        instruction, input_text = row.get("instruction") or "", row.get("input") or ""
        prompt = f"{instruction}\n{input_text}" if input_text else instruction
        return Trajectory(
            messages=[
                Message(role="user", content=prompt),
                Message(role="assistant", content=row.get("output") or ""),
            ]
        )


class CompetitionMathProcessor(Preprocessor):
    """``problem``/``solution`` rows -> a user/assistant chat."""

    def preprocess(self, row: Row) -> Trajectory:
        """The chat of one competition-math row."""
        return Trajectory(
            messages=[
                Message(role="user", content=row["problem"]),
                Message(role="assistant", content=row["solution"]),
            ]
        )


class CompetitionMathGRPOProcessor(Preprocessor):
    """``problem``/``solution`` rows -> a prompt for sampling (empty assistant turn) with the
    solution in ``user_data``."""

    SYSTEM = (
        "You are a helpful math assistant. Respond with only the final answer in the form "
        "\\boxed{...} and nothing else."
    )

    def preprocess(self, row: Row) -> Trajectory:
        """The prompt of one competition-math row."""
        return Trajectory(
            messages=[
                Message(role="system", content=self.SYSTEM),
                Message(role="user", content=row["problem"]),
                Message(role="assistant", content=""),
            ],
            user_data=[("solution", row["solution"])],
        )


class CountdownProcessor(Preprocessor):
    """``nums`` and ``target`` (or ``response``) rows -> a Countdown prompt; both go to
    ``user_data``."""

    system_prompt = (
        "You are a helpful assistant. You first thinks about the reasoning process "
        "in the mind and then provides the user with the answer."
    )

    def preprocess(self, row: Row) -> Trajectory:
        """The prompt of one Countdown row."""
        nums = row.get("nums", [])
        target = row.get("response", row.get("target", 0))
        query = (
            f"Using the numbers {nums}, create an equation that equals {target}.\n"
            "You can use basic arithmetic operations (+, -, *, /) and each number can only be "
            "used once.\nShow your work in <think> </think> tags. And return the final equation "
            "and answer in <answer> </answer> tags,\nfor example <answer> (1 + 2) / 3 * 4 = 4 "
            "</answer>."
        )
        return Trajectory(
            messages=[
                Message(role="system", content=self.system_prompt),
                Message(role="user", content=query),
            ],
            user_data=[{"target": target, "nums": nums}],
        )


class GSM8KProcessor(Preprocessor):
    """GSM8K ``question``/``answer`` rows -> a prompt, the number after ``####`` stored as
    ``user_data`` ``ground_truth``; `add_assistant` appends the answer as the assistant turn."""

    system_prompt = (
        "You are a helpful math assistant. Solve the problem step by step "
        "and put your final answer within \\boxed{}."
    )

    def __init__(self, system: str | None = None, add_assistant: bool = False) -> None:
        self.system = self.system_prompt if system is None else system
        self.add_assistant = add_assistant

    @staticmethod
    def extract_ground_truth(answer_str: str) -> str:
        """The number after ``####`` without thousands separators ('' when there is none)."""
        match = re.search(r"####\s*([\-\d,.]+)", answer_str)
        return match.group(1).replace(",", "").strip() if match else ""

    def preprocess(self, row: Row) -> Trajectory:
        """The prompt (and, with `add_assistant`, the answer) of one GSM8K row."""
        answer = row.get("answer", "")
        messages = [
            Message(role="system", content=self.system),
            Message(role="user", content=row["question"]),
        ]
        if self.add_assistant:
            messages.append(Message(role="assistant", content=answer))
        return Trajectory(
            messages=messages, user_data=[("ground_truth", self.extract_ground_truth(answer))]
        )


class EmojiDPOProcessor(Preprocessor):
    """Preference rows -> ``positive`` (chosen) and ``negative`` (rejected) trajectories.

    Keys default to shareAI/DPO-zh-en-emoji's: ``prompt``, ``answer_zh`` (chosen),
    ``answer_en`` (rejected); `system` is prepended when given.
    """

    def __init__(
        self,
        system: str | None = None,
        chosen_key: str = "answer_zh",
        rejected_key: str = "answer_en",
        prompt_key: str = "prompt",
    ) -> None:
        self.system = system
        self.chosen_key = chosen_key
        self.rejected_key = rejected_key
        self.prompt_key = prompt_key

    def preprocess(self, row: Row) -> dict[str, Trajectory]:
        """The chosen and rejected chats of one row."""
        prompt: list[Message] = []
        if self.system:
            prompt.append(Message(role="system", content=self.system))
        prompt.append(Message(role="user", content=row.get(self.prompt_key, "")))
        return {
            "positive": Trajectory(
                messages=[*prompt, Message(role="assistant", content=row.get(self.chosen_key, ""))]
            ),
            "negative": Trajectory(
                messages=[
                    *prompt,
                    Message(role="assistant", content=row.get(self.rejected_key, "")),
                ]
            ),
        }

    def __call__(self, rows: Mapping[str, Sequence[Any]]) -> Columns:
        return self.map_row_to_col(
            [self.preprocess(row) for row in self.map_col_to_row(rows)], ["positive", "negative"]
        )
