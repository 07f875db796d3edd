"""Upstream Twinkle's `twinkle.dataset`: `DatasetMeta` sources and slices, batched `map`,
`LazyDataset`, `IterableDataset` and `PackingDataset`, read the way its cookbooks read them."""

import csv
import json

import pytest
import torch

from twinkle.dataset import Dataset, DatasetMeta, IterableDataset, LazyDataset, PackingDataset
from twinkle.hub import HubUnavailableError
from twinkle.preprocessor import DataFilter, SelfCognitionProcessor
from twinkle.processor import InputProcessor
from twinkle.template import Template
from twinkle_fn.data import char_tokenizer

ROWS = [{"query": f"q{i} {{{{NAME}}}}", "response": f"r{i} {{{{AUTHOR}}}}"} for i in range(5)]


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def test_json_csv_jsonl_and_directories_load_the_same_rows(tmp_path):
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    (tmp_path / "b.json").write_text(json.dumps(ROWS))
    (tmp_path / "c.json").write_text(json.dumps({k: [r[k] for r in ROWS] for k in ROWS[0]}))
    with open(tmp_path / "d.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, ["query", "response"])
        writer.writeheader()
        writer.writerows(ROWS)
    for name in ("a.jsonl", "b.json", "c.json", "d.csv"):
        assert Dataset(DatasetMeta(str(tmp_path / name)))[:] == ROWS, name
    data_dir = tmp_path / "dir"
    data_dir.mkdir()
    (data_dir / "x.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    (data_dir / "y.jsonl").write_text(json.dumps(ROWS[1]) + "\n")
    assert Dataset(DatasetMeta(str(data_dir)))[:] == ROWS[:2]


def test_meta_sources_and_wrapping_slices():
    with pytest.raises(ValueError, match="needs data="):
        DatasetMeta()
    with pytest.raises(ValueError, match="data_slice must be an iterable"):
        DatasetMeta(data=ROWS, data_slice=3)
    columns = {"query": ["a", "b"], "response": ["c", "d"]}
    assert Dataset(DatasetMeta(data=columns))[1] == {"query": "b", "response": "d"}
    assert len(Dataset(DatasetMeta(data=lambda: iter(ROWS)))) == 5
    # indices past the end wrap around, as upstream's data_slice
    sliced = Dataset(DatasetMeta(data=ROWS, data_slice=range(3, 8)))
    assert [r["query"][:2] for r in sliced[:]] == ["q3", "q4", "q0", "q1", "q2"]
    a, b = DatasetMeta(data=ROWS), DatasetMeta(data=ROWS)
    assert (
        a.get_id() != b.get_id() and DatasetMeta("x/y.jsonl").get_id() == "x_y_jsonl:default:train"
    )
    with pytest.raises(HubUnavailableError, match="ms://swift/self-cognition"):
        Dataset(DatasetMeta("ms://swift/self-cognition"))


def test_map_is_batched_and_takes_preprocessor_names():
    seen = []

    def add_len(batch):
        seen.append(len(batch["query"]))
        return {"n": [len(q) for q in batch["query"]]}

    ds = Dataset(DatasetMeta(data=ROWS))
    ds.map(add_len, batch_size=2)
    assert seen == [2, 2, 1]
    assert ds[0] == {**ROWS[0], "n": len(ROWS[0]["query"])}  # columns merged into the rows
    ds.map("SelfCognitionProcessor", init_args={"model_name": "tw", "model_author": "ms"})
    assert ds[0]["messages"][1]["content"] == "q0 tw" and ds[0]["query"] == ROWS[0]["query"]
    ds.map(lambda batch: {"query": batch["query"][:1]}, remove_columns=["query"])
    assert ds[:] == [{"query": ROWS[0]["query"]}]  # another row count replaces the batch
    with pytest.raises(ValueError, match="not a Preprocessor"):
        ds.map("NoSuchProcessor")
    with pytest.raises(TypeError, match="equal-length lists"):
        ds.map(lambda batch: {"a": [1], "b": [1, 2]})


def test_filter_takes_datafilter_classes():
    class Even(DataFilter):
        def __init__(self, keep):
            self.keep = keep

        def __call__(self, row):
            return int(row["query"][1]) % 2 == self.keep

    ds = Dataset(DatasetMeta(data=ROWS))
    ds.filter(Even, init_args={"keep": 0})
    assert [r["query"][:2] for r in ds[:]] == ["q0", "q2", "q4"]


def test_lazy_dataset_maps_and_encodes_when_read(tok):
    calls = []

    class Counting(SelfCognitionProcessor):
        def preprocess(self, row):
            calls.append(row["query"])
            return super().preprocess(row)

    ds = LazyDataset(DatasetMeta(data=ROWS))
    ds.map(Counting)
    ds.set_template(Template(tok))
    ds.encode()
    assert calls == []
    row = ds[2]
    assert calls == [ROWS[2]["query"]]
    eager = Dataset(DatasetMeta(data=ROWS[2:3]))
    eager.map(SelfCognitionProcessor)
    eager.set_template(Template(tok))
    eager.encode()
    assert row["input_ids"] == eager[0]["input_ids"] and "messages" in row
    plain = LazyDataset(DatasetMeta(data=ROWS))
    plain.map(lambda batch: {"k": [q.upper() for q in batch["query"]]})
    assert plain[0]["k"] == ROWS[0]["query"].upper() and len(plain) == 5
    plain.set_template(Template(tok, truncation_strategy="delete", max_length=4))
    with pytest.raises(ValueError, match="cannot drop rows"):
        plain.encode()


def test_iterable_dataset_is_only_iterated():
    ds = IterableDataset(DatasetMeta(data=ROWS), streaming=True)
    ds.filter(lambda row: row["query"].startswith("q1"))
    assert [row for row in ds] == [ROWS[1]]  # list(ds) would ask len(), as upstream
    with pytest.raises(NotImplementedError):
        len(ds)
    with pytest.raises(NotImplementedError):
        ds[0]


def test_packing_dataset_packs_to_max_length_and_the_processor_unpacks(tok):
    ds = PackingDataset(DatasetMeta(data=ROWS))
    ds.map(SelfCognitionProcessor)
    ds.set_template(Template(tok, max_length=256))
    with pytest.raises(RuntimeError, match="pack_dataset"):
        len(ds)
    ds.encode()
    singles = list(ds.rows)
    ds.pack_dataset()
    assert 1 <= len(ds) < len(singles)
    packed = ds[:]
    assert all(len(row["input_ids"]) <= 256 for row in packed)
    assert sum(len(row["length"]) for row in packed) == len(singles)
    first = packed[0]
    assert first["position_ids"].count(0) == len(first["length"])
    batch = InputProcessor()([first])
    assert batch["cu_seqlens"].tolist() == [0, *torch.tensor(first["length"]).cumsum(0).tolist()]
    parts = [s for s in singles if s["input_ids"] in _cut(first)]
    assert len(parts) == len(first["length"])


def _cut(row):
    out, start = [], 0
    for n in row["length"]:
        out.append(row["input_ids"][start : start + n])
        start += n
    return out


def test_mix_dataset_interleaves_until_the_first_source_runs_out():
    """Upstream: ``datasets`` holds each source; ``mix_dataset(interleave=True)`` takes a row of
    each in turn and stops when one runs out; concatenation keeps the sources' order."""
    a, b = [{"t": f"a{i}"} for i in range(4)], [{"t": f"b{i}"} for i in range(2)]
    ds = Dataset(DatasetMeta(data=a))
    ds.add_dataset(DatasetMeta(data=b))
    assert [len(rows) for rows in ds.datasets.values()] == [4, 2]
    ds.mix_dataset(interleave=False)
    assert [r["t"] for r in ds.dataset] == ["a0", "a1", "a2", "a3", "b0", "b1"]
    ds.mix_dataset(interleave=True)
    assert [r["t"] for r in ds.dataset] == ["a0", "b0", "a1", "b1"]
    fresh = Dataset(DatasetMeta(data=a))
    fresh.add_dataset(DatasetMeta(data=b))
    fresh.map(lambda batch: {"t": [t.upper() for t in batch["t"]]})
    with pytest.raises(ValueError, match="must come before map/filter/encode"):
        fresh.mix_dataset()
