"""`IterableDataset`: a `Dataset` read by iterating; upstream's
``twinkle.dataset.iterable_dataset``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset as TorchIterableDataset

from twinkle.dataset._rows import Row
from twinkle.dataset._sources import DatasetMeta
from twinkle.dataset.base import Dataset
from twinkle.infra import remote_class


@remote_class(execute="first")
class IterableDataset(Dataset, TorchIterableDataset):
    """A `Dataset` read by iterating (upstream's streaming variant): no `len`, no indexing; a
    ``torch.utils.data.IterableDataset``, as upstream's, so a `DataLoader` streams it.

    Rows are loaded into memory here; ``streaming`` is accepted. ``__len__`` and
    ``__getitem__`` raise ``NotImplementedError`` as upstream's.
    """

    def __init__(self, dataset_meta: DatasetMeta | None = None, **load_kwargs: Any) -> None:
        load_kwargs.pop("streaming", None)
        super().__init__(dataset_meta, **load_kwargs)

    def __len__(self) -> int:
        raise NotImplementedError("an IterableDataset has no length; iterate over it")

    def __getitem__(self, index: int | slice) -> Row | list[Row]:
        raise NotImplementedError("an IterableDataset cannot be indexed; iterate over it")

    def __iter__(self) -> Iterator[Row]:
        return iter(list(self.rows))

    @property
    def dataset(self) -> Iterator[Row]:
        """The rows served, as a stream (no length, as upstream's streaming dataset)."""
        return iter(self)
