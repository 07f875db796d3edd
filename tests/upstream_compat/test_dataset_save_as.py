"""`Dataset.save_as`: the rows served, written as jsonl / json (JSON lines) / csv, that load
back as the same rows; what it does not do is refused naming the fix."""

import csv
import json

import pytest

from twinkle.dataset import Dataset, DatasetMeta

ROWS = [
    {"query": "who are you?", "response": "I am {{NAME}}.", "ids": [1, 2, 3]},
    {"query": "你好", "response": "hi, from {{AUTHOR}}", "ids": [4]},
]


@pytest.fixture
def dataset(tmp_path):
    source = tmp_path / "source.jsonl"
    source.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ROWS))
    data = Dataset(DatasetMeta(str(source)))
    data.filter(lambda row: row["query"] != "nothing")
    return data


@pytest.mark.parametrize("name", ["out.jsonl", "out.json", "other.txt"])
def test_json_lines_load_back_as_the_same_rows(dataset, tmp_path, name):
    path = tmp_path / "saved" / name
    dataset.save_as(path, format="json" if name == "other.txt" else None)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == ROWS
    assert "你好" in lines[1]  # written as UTF-8, not escaped
    if name != "other.txt":
        assert Dataset(DatasetMeta(str(path))).dataset == ROWS
    assert [p.name for p in path.parent.iterdir()] == [name]  # no staging file left


def test_csv_has_a_header_and_json_for_lists(dataset, tmp_path):
    path = tmp_path / "out.csv"
    dataset.save_as(path)
    with open(path, newline="", encoding="utf-8") as f:
        table = list(csv.reader(f))
    assert table[0] == ["query", "response", "ids"]
    assert table[1] == ["who are you?", "I am {{NAME}}.", "[1, 2, 3]"]
    assert [json.loads(v) for v in (table[1][2], table[2][2])] == [[1, 2, 3], [4]]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"output_path": "x.parquet"}, ValueError, "parquet needs pyarrow"),
        ({"output_path": "x.xml", "format": "xml"}, ValueError, "Unsupported format 'xml'"),
        ({"output_path": "x.jsonl", "mode": "training"}, ValueError, "only mode='immediate'"),
        ({"output_path": "x.jsonl", "lines": False}, TypeError, r"unsupported arguments \['lines'"),
    ],
)
def test_refusals(dataset, tmp_path, kwargs, error, match):
    kwargs["output_path"] = tmp_path / kwargs["output_path"]
    with pytest.raises(error, match=match):
        dataset.save_as(**kwargs)
    assert not list(tmp_path.glob("x*"))
