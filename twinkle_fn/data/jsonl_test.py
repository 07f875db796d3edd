import json

import pytest

from twinkle_fn.data.chat import encode_messages, encode_text
from twinkle_fn.data.jsonl import encode_rows, load_jsonl
from twinkle_fn.data.tokenizer import char_tokenizer

CHAT = {
    "messages": [
        {"role": "user", "content": "What is 1 + 1?"},
        {"role": "assistant", "content": "2"},
    ],
    "id": 7,
}
TEXT = {"text": "plain text\n"}


def _write(tmp_path, lines):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_load_jsonl_reads_rows_and_skips_blank_lines(tmp_path):
    path = _write(tmp_path, [json.dumps(CHAT), "", "   ", json.dumps(TEXT)])
    assert load_jsonl(path) == [CHAT, TEXT]
    assert load_jsonl(str(path)) == [CHAT, TEXT]


@pytest.mark.parametrize(
    ("bad_line", "error", "match"),
    [
        ('{"text": "a"', ValueError, r"data\.jsonl:2: invalid JSON"),
        ("[1, 2]", TypeError, r"data\.jsonl:2: a row must be a JSON object"),
        ('{"prompt": "a"}', ValueError, r"data\.jsonl:2: .*'messages'.*'text'.*got neither"),
        ('{"text": "a", "messages": []}', ValueError, r"data\.jsonl:2: .*got both"),
        ('{"text": 3}', TypeError, r"data\.jsonl:2: 'text' must be a str, got int"),
        ('{"messages": "hi"}', TypeError, r"data\.jsonl:2: messages must be a list"),
        (
            '{"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}',
            ValueError,
            r"data\.jsonl:2: messages\[1\]\['role'\] must be one of",
        ),
        (
            '{"messages": [{"role": "user", "content": 1}]}',
            TypeError,
            r"data\.jsonl:2: messages\[0\]\['content'\] must be a str",
        ),
    ],
)
def test_load_jsonl_errors_name_file_line_and_field(tmp_path, bad_line, error, match):
    path = _write(tmp_path, [json.dumps(TEXT), bad_line])
    with pytest.raises(error, match=match):
        load_jsonl(path)


def test_load_jsonl_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_jsonl(tmp_path / "absent.jsonl")


def test_encode_rows_dispatches_on_row_kind():
    tok = char_tokenizer()
    features = encode_rows(tok, [CHAT, TEXT], max_length=30)
    assert features == [
        encode_messages(tok, CHAT["messages"], max_length=30),
        encode_text(tok, TEXT["text"], max_length=30),
    ]


def test_encode_rows_names_the_bad_row():
    with pytest.raises(ValueError, match=r"rows\[1\]: .*got neither"):
        encode_rows(char_tokenizer(), [TEXT, {"prompt": "a"}])
    with pytest.raises(ValueError, match=r"rows\[0\]: messages\[0\]\['role'\]"):
        encode_rows(char_tokenizer(), [{"messages": [{"role": "x", "content": "a"}]}])


def test_a_binary_file_is_named_with_its_line(tmp_path):
    """Today: a bare UnicodeDecodeError that names no file."""
    path = tmp_path / "data.jsonl"
    path.write_bytes(json.dumps(TEXT).encode() + b'\n{"text": "\xff\xfe"}\n')
    with pytest.raises(
        ValueError, match=r"data\.jsonl:2: not UTF-8 text \(byte 0xff at column 11\).*binary"
    ):
        load_jsonl(path)


@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_a_file_without_rows_is_named(tmp_path, content):
    """Today: [] and, in `twinkle train`, an error about splitting 0 questions."""
    path = tmp_path / "data.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=r"data\.jsonl: no rows \(the file is empty or blank\)"):
        load_jsonl(path)


def test_a_json_string_may_hold_a_unicode_line_separator(tmp_path):
    row = {"text": "a\u2028b\x1cc"}
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(row, ensure_ascii=False) + "\n", encoding="utf-8")
    assert load_jsonl(path) == [row]
