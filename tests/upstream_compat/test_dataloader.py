"""`DataLoader` as upstream documents it: a torch ``sampler=`` orders the rows, a stream (a
``torch.utils.data.IterableDataset``) is cut into global batches, a resume skips exactly the
consumed rows, and csv columns load typed."""

import warnings

import numpy as np
import pytest
from torch.utils.data import IterableDataset as TorchIterableDataset
from torch.utils.data import SequentialSampler

from twinkle import DeviceMesh
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta, IterableDataset

ROWS = [{"x": i} for i in range(6)]


class _Reversed(SequentialSampler):
    def __iter__(self):
        return iter(reversed(range(len(self.data_source))))


class _Stream(TorchIterableDataset):
    def __iter__(self):
        return iter(ROWS)


def _xs(batches):
    return [[row["x"] for row in batch] for batch in batches]


def test_a_sampler_orders_the_rows_and_conflicts_with_shuffle():
    assert _xs(DataLoader(ROWS, batch_size=4, sampler=_Reversed(ROWS))) == [[5, 4, 3, 2], [1, 0]]
    with pytest.raises(ValueError, match="sampler= or shuffle=True"):
        DataLoader(ROWS, batch_size=2, sampler=_Reversed(ROWS), shuffle=True)
    assert _xs(DataLoader(ROWS, batch_size=4, max_retries=3)) == [[0, 1, 2, 3], [4, 5]]


def test_a_stream_is_cut_into_global_batches_sliced_per_data_rank(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    mesh = DeviceMesh(mesh=np.array([0, 1]), mesh_dim_names=("dp",))
    assert _xs(DataLoader(_Stream(), batch_size=4, device_mesh=mesh)) == [[2, 3], [5]]
    loader = DataLoader(IterableDataset(DatasetMeta(data=ROWS)), batch_size=4)
    assert _xs(loader) == [[0, 1, 2, 3], [4, 5]]
    with pytest.raises(TypeError, match="no length"):
        len(loader)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader.skip_consumed_samples(2)
    assert "does not support consumed-data skipping" in str(caught[0].message)
    assert _xs(loader)[0] == [0, 1, 2, 3]  # nothing skipped


def test_a_resume_skips_exactly_the_consumed_rows_before_the_rank_slice(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    mesh = DeviceMesh(mesh=np.array([0, 1]), mesh_dim_names=("dp",))
    loader = DataLoader(ROWS, batch_size=4, device_mesh=mesh)
    loader.skip_consumed_samples(2)  # half a global batch: rows 2.. remain
    assert len(loader) == 1 and _xs(loader) == [[2, 3]]
    assert _xs(loader) == [[0, 1], [4]]  # the next epoch starts over


def test_csv_columns_load_typed_as_upstreams_loader(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("text,label,score,code,note\nhi,0,0.5,007,\nyo,-3,2,12,x\n")
    rows = Dataset(DatasetMeta(dataset_id=str(path)))[:]
    assert rows == [
        {"text": "hi", "label": 0, "score": 0.5, "code": 7, "note": ""},
        {"text": "yo", "label": -3, "score": 2.0, "code": 12, "note": "x"},
    ]
