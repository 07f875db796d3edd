import re

import pytest

from twinkle_fn.data.arithmetic import arithmetic_dataset, train_heldout_split
from twinkle_fn.data.chat import validate_messages

QUESTION = re.compile(r"What is (\d+) ([+*-]) (\d+)\?")


def _question(row):
    return row["messages"][0]["content"]


def test_rows_are_correct_chats():
    rows = arithmetic_dataset(300, seed=1, max_operand=20)
    assert len(rows) == 300
    ops = set()
    for row in rows:
        validate_messages(row["messages"])
        user, assistant = row["messages"]
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        a, op, b = QUESTION.fullmatch(user["content"]).groups()
        a, b = int(a), int(b)
        assert 0 <= a <= 20 and 0 <= b <= 20
        expected = {"+": a + b, "-": a - b, "*": a * b}[op]
        assert assistant["content"] == str(expected)
        assert expected >= 0
        ops.add(op)
    assert ops == {"+", "-", "*"}


def test_dataset_is_deterministic_in_the_seed():
    assert arithmetic_dataset(50, seed=3) == arithmetic_dataset(50, seed=3)
    assert arithmetic_dataset(50, seed=3) != arithmetic_dataset(50, seed=4)
    assert arithmetic_dataset(0) == []


def test_dataset_rejects_negative_arguments():
    with pytest.raises(ValueError, match="num_samples"):
        arithmetic_dataset(-1)
    with pytest.raises(ValueError, match="max_operand"):
        arithmetic_dataset(3, max_operand=-1)


def test_split_is_a_disjoint_partition_by_question():
    # max_operand=5 makes repeated questions certain, so the grouping is exercised.
    rows = arithmetic_dataset(400, seed=0, max_operand=5)
    train, heldout = train_heldout_split(rows, heldout_fraction=0.2, seed=7)
    assert len(train) + len(heldout) == len(rows)
    assert sorted(map(repr, train + heldout)) == sorted(map(repr, rows))
    assert not {_question(r) for r in train} & {_question(r) for r in heldout}
    distinct = {_question(r) for r in rows}
    assert len({_question(r) for r in heldout}) == round(0.2 * len(distinct))
    # Each side keeps the input order.
    positions = {id(r): i for i, r in enumerate(rows)}
    for side in (train, heldout):
        assert [positions[id(r)] for r in side] == sorted(positions[id(r)] for r in side)


def test_split_is_deterministic_and_seeded():
    rows = arithmetic_dataset(200, seed=0)
    assert train_heldout_split(rows, seed=1) == train_heldout_split(rows, seed=1)
    assert train_heldout_split(rows, seed=1)[1] != train_heldout_split(rows, seed=2)[1]


def test_split_handles_text_rows_and_keeps_both_sides_non_empty():
    rows = [{"text": "a"}, {"text": "b"}, {"text": "a"}]
    train, heldout = train_heldout_split(rows, heldout_fraction=0.01)
    assert len({r["text"] for r in heldout}) == 1 and train and heldout
    train, heldout = train_heldout_split(rows, heldout_fraction=0.99)
    assert len({r["text"] for r in train}) == 1


def test_split_errors():
    rows = arithmetic_dataset(10)
    for bad in (0.0, 1.0, -0.5):
        with pytest.raises(ValueError, match="heldout_fraction"):
            train_heldout_split(rows, heldout_fraction=bad)
    with pytest.raises(ValueError, match="at least two distinct questions"):
        train_heldout_split(rows[:1] * 5)
