"""`DataLoader`: global batches, each data rank taking its contiguous share.

``batch_size`` is the *global* batch; each step every data rank yields
``batch[device_mesh.get_slice(len(batch))]`` (tp/pp/cp peers of a data rank get the same rows).
The sampler runs inside ``torch.utils.data.DataLoader``, so its keyword arguments (``shuffle``
aside, handled here so every rank draws the same order; ``num_workers``...) apply. Batches are
lists of rows (identity collation): the model's processor collates them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Sampler

from twinkle.device_mesh import DeviceMesh
from twinkle.infra import remote_class, remote_function


class DeviceMeshSampler(Sampler[list[int]]):
    """Index lists of this data rank's share of each global batch, from `start_batch` on.

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
    ) -> None:
        self.num_rows = num_rows
        self.batch_size = batch_size
        self.device_mesh = device_mesh
        self.min_batch_size = min_batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.start_batch = 0

    def batches_per_epoch(self) -> int:
        """Global batches in a whole epoch (a short last one counts if it has enough rows)."""
        full, rest = divmod(self.num_rows, self.batch_size)
        return full + int(rest > 0 and rest >= self.min_batch_size)

    def __len__(self) -> int:
        return max(self.batches_per_epoch() - self.start_batch, 0)

    def __iter__(self) -> Iterator[list[int]]:
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_rows, generator=gen).tolist()
        else:
            order = list(range(self.num_rows))
        for start in range(self.start_batch * self.batch_size, self.num_rows, self.batch_size):
            batch = order[start : start + self.batch_size]
            if len(batch) < self.min_batch_size:
                return
            if self.device_mesh is not None and self.device_mesh.data_world_size > 1:
                batch = batch[self.device_mesh.get_slice(len(batch))]
            yield batch


@remote_class(execute="first")
class DataLoader:
    """Iterates over `dataset` in global batches of `batch_size` rows, sliced per data rank.

    `dataset` is a `twinkle.dataset.Dataset`, any sequence of rows, or a callable returning one.
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
        **torch_kwargs: Any,
    ) -> None:
        self.dataset = _as_sequence(dataset() if callable(dataset) else dataset)
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
        self.sampler = DeviceMeshSampler(
            len(self.dataset),
            batch_size,
            device_mesh,
            batch_size if drop_last else (min_batch_size or data_ranks),
            shuffle,
            seed,
        )
        self.collate_fn = collate_fn or _identity
        self.torch_kwargs = torch_kwargs
        self.consumed_train_samples = 0

    def __len__(self) -> int:
        """Global batches left in this epoch."""
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
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
            self.sampler.start_batch = 0
            self.sampler.epoch += 1

    @remote_function(execute="first")
    def get_state(self) -> dict[str, int]:
        """``{"consumed_train_samples": n}``: global rows yielded so far (for resuming)."""
        return {"consumed_train_samples": self.consumed_train_samples}

    @remote_function(execute="first")
    def skip_consumed_samples(self, consumed_train_samples: int) -> None:
        """Resume: the next epoch starts after `consumed_train_samples` global rows (whole
        batches, counted within the epoch). Raises ``ValueError`` for a negative count."""
        if consumed_train_samples < 0:
            raise ValueError(f"consumed_train_samples must be >= 0, got {consumed_train_samples}")
        per_epoch = max(self.sampler.batches_per_epoch(), 1) * self.batch_size
        self.sampler.start_batch = (consumed_train_samples % per_epoch) // self.batch_size
        self.consumed_train_samples = consumed_train_samples

    @remote_function(execute="first")
    def resume_from_checkpoint(self, consumed_train_samples: int) -> None:
        """Upstream's alias of `skip_consumed_samples`."""
        self.skip_consumed_samples(consumed_train_samples)


def _identity(batch: list[Any]) -> list[Any]:
    return batch


def _as_sequence(dataset: Any) -> Sequence[Any]:
    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        return dataset
    raise TypeError(f"a dataset needs __len__ and __getitem__, got {type(dataset).__name__}")
