"""`DataLoader`: global batches, each data rank taking its contiguous share.

``batch_size`` is the *global* batch; each step every data rank yields
``batch[device_mesh.get_slice(len(batch))]`` (tp/pp/cp peers of a data rank get the same rows).
The sampler runs inside ``torch.utils.data.DataLoader``, so its keyword arguments (``shuffle``
aside, handled here so every rank draws the same order; ``num_workers``...) apply. Batches are
lists of rows (identity collation): the model's processor collates them.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Sampler

from twinkle.device_mesh import DeviceMesh
from twinkle.infra import remote_class, remote_function


class DeviceMeshSampler(Sampler[list[int]]):
    """Index lists of this data rank's share of each global batch, from row `start_row` of the
    epoch's order on (a resumed epoch skips exactly the rows already consumed, as upstream).

    Every rank draws the same order (a permutation seeded by ``seed + epoch`` when shuffling),
    so the shares are disjoint and cover each global batch. A global batch with fewer than
    `min_batch_size` rows ends the epoch.
    """

    def __init__(
        self,
        num_rows: int,
        batch_size: int,
        device_mesh: DeviceMesh | None,
        min_batch_size: int,
        shuffle: bool,
        seed: int,
        order: Iterable[int] | None = None,
    ) -> None:
        self.order = order
        self.num_rows = len(order) if order is not None else num_rows
        self.batch_size = batch_size
        self.device_mesh = device_mesh
        self.min_batch_size = min_batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.start_row = 0

    def batches_per_epoch(self, start_row: int = 0) -> int:
        """Global batches of an epoch from `start_row` on (a short last one counts if it has
        enough rows)."""
        full, rest = divmod(max(self.num_rows - start_row, 0), self.batch_size)
        return full + int(rest > 0 and rest >= self.min_batch_size)

    def __len__(self) -> int:
        return self.batches_per_epoch(self.start_row)

    def __iter__(self) -> Iterator[list[int]]:
        if self.order is not None:  # a user's sampler draws the order, anew each epoch
            order = [int(i) for i in self.order]
        elif self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_rows, generator=gen).tolist()
        else:
            order = list(range(self.num_rows))
        for start in range(self.start_row, self.num_rows, self.batch_size):
            batch = order[start : start + self.batch_size]
            if len(batch) < self.min_batch_size:
                return
            if self.device_mesh is not None and self.device_mesh.data_world_size > 1:
                batch = batch[self.device_mesh.get_slice(len(batch))]
            yield batch


@remote_class(execute="first")
class DataLoader:
    """Iterates over `dataset` in global batches of `batch_size` rows, sliced per data rank.

    `dataset` is a `twinkle.dataset.Dataset`, any sequence of rows, an iterable of rows (a
    stream: read in order, cut into global batches, and not resumable), or a callable returning
    one. `sampler` (a ``torch.utils.data.Sampler`` or any sized iterable of row indices) draws
    the order of a sequence's rows each epoch instead of `shuffle`. `max_retries` is upstream's
    retry budget for rows that fail to load; rows here are in memory and a failing row raises,
    so it is accepted and unused.
    `min_batch_size` (default: the number of data ranks, as upstream; `batch_size` with
    `drop_last`) ends an epoch at a smaller final batch. `shuffle` draws a new order every epoch from `seed`. Other keyword
    arguments go to ``torch.utils.data.DataLoader``. Raises ``ValueError`` when `batch_size` is
    not a positive multiple of the mesh's data ranks.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        batch_size: int,
        min_batch_size: int | None = None,
        device_mesh: DeviceMesh | None = None,
        shuffle: bool = False,
        drop_last: bool = False,
        seed: int = 42,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        sampler: Iterable[int] | None = None,
        max_retries: int = 20,
        **torch_kwargs: Any,
    ) -> None:
        dataset = dataset() if callable(dataset) else dataset
        self.dataset = dataset if _is_stream(dataset) else _as_sequence(dataset)
        if sampler is not None and shuffle:
            raise ValueError("pass sampler= or shuffle=True, not both: the sampler draws the order")
        data_ranks = device_mesh.data_world_size if device_mesh is not None else 1
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if batch_size % data_ranks:
            raise ValueError(
                f"batch_size={batch_size} (the global batch) must be divisible by the mesh's "
                f"{data_ranks} data ranks (dp x fsdp); use a multiple of {data_ranks}"
            )
        self.batch_size = batch_size
        self.device_mesh = device_mesh
        self.min_batch_size = batch_size if drop_last else (min_batch_size or data_ranks)
        self.sampler = DeviceMeshSampler(
            0 if _is_stream(self.dataset) else len(self.dataset),
            batch_size,
            device_mesh,
            self.min_batch_size,
            shuffle,
            seed,
            sampler,
        )
        self.collate_fn = collate_fn or _identity
        self.torch_kwargs = torch_kwargs
        self.consumed_train_samples = 0

    def __len__(self) -> int:
        """Global batches left in this epoch. Raises ``TypeError`` for a stream."""
        if _is_stream(self.dataset):
            raise TypeError("a DataLoader over an iterable dataset has no length; iterate it")
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        if _is_stream(self.dataset):
            yield from self._iter_stream()
            return
        loader = TorchDataLoader(
            self.dataset,
            batch_sampler=self.sampler,
            collate_fn=self.collate_fn,
            **self.torch_kwargs,
        )
        try:
            for batch in loader:
                self.consumed_train_samples += self.batch_size
                yield batch
        finally:
            self.sampler.start_row = 0
            self.sampler.epoch += 1

    def _iter_stream(self) -> Iterator[Any]:
        """This data rank's share of each global batch cut from the stream, in order."""
        rows = iter(self.dataset)
        while (batch := list(itertools.islice(rows, self.batch_size))) and len(
            batch
        ) >= self.min_batch_size:
            if self.device_mesh is not None and self.device_mesh.data_world_size > 1:
                batch = batch[self.device_mesh.get_slice(len(batch))]
            self.consumed_train_samples += self.batch_size
            yield self.collate_fn(batch)

    @remote_function(execute="first")
    def get_state(self) -> dict[str, int]:
        """``{"consumed_train_samples": n}``: global rows yielded so far (for resuming)."""
        return {"consumed_train_samples": self.consumed_train_samples}

    @remote_function(execute="first")
    def skip_consumed_samples(self, consumed_train_samples: int) -> None:
        """Resume: the next epoch starts after `consumed_train_samples` global rows of its order
        (counted within the epoch, each batch as `batch_size` rows). An iterable dataset cannot
        skip: it warns and starts from its first row. Raises ``ValueError`` for a negative
        count."""
        if consumed_train_samples < 0:
            raise ValueError(f"consumed_train_samples must be >= 0, got {consumed_train_samples}")
        if _is_stream(self.dataset):
            warnings.warn(
                "an iterable dataset does not support consumed-data skipping; continuing "
                "without skipping (use a map-style dataset to resume mid-epoch)",
                UserWarning,
                stacklevel=2,
            )
            return
        per_epoch = max(self.sampler.batches_per_epoch(), 1) * self.batch_size
        self.sampler.start_row = consumed_train_samples % per_epoch
        self.consumed_train_samples = consumed_train_samples

    @remote_function(execute="first")
    def resume_from_checkpoint(self, consumed_train_samples: int) -> None:
        """Upstream's alias of `skip_consumed_samples`."""
        self.skip_consumed_samples(consumed_train_samples)


def _identity(batch: list[Any]) -> list[Any]:
    return batch


def _is_stream(dataset: Any) -> bool:
    """Whether `dataset` is read by iterating: a ``torch.utils.data.IterableDataset``, or an
    iterable without ``__getitem__``."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return True
    return hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__")


def _as_sequence(dataset: Any) -> Sequence[Any]:
    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        return dataset
    raise TypeError(f"a dataset needs __len__ and __getitem__, got {type(dataset).__name__}")
