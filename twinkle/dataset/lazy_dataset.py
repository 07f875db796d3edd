"""`LazyDataset`: `map` and `encode` run on each row when it is read; upstream's
``twinkle.dataset.lazy_dataset``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from twinkle.dataset._rows import Row
from twinkle.dataset._sources import DatasetMeta
from twinkle.dataset._transforms import _apply_to_row, make_callable
from twinkle.dataset.base import Dataset
from twinkle.infra import remote_class, remote_function
from twinkle.preprocessor import Preprocessor


@remote_class(execute="first")
class LazyDataset(Dataset):
    """A `Dataset` whose `map` and `encode` run on each row when it is read, as upstream.

    `filter` runs at once, on the rows as loaded (before any recorded map), as upstream's.
    A recorded `Preprocessor` converts a row with its ``preprocess`` (the row is replaced); a
    plain function gets a one-row batch of columns. An encoded row keeps the fields that encoding
    does not produce.
    """

    def __init__(self, dataset_meta: DatasetMeta | None = None, **load_kwargs: Any) -> None:
        super().__init__(dataset_meta, **load_kwargs)
        self._map_ops: list[Callable[..., Any]] = []
        self.do_encode = False
        self.add_generation_prompt = False

    @remote_function(execute="first")
    def map(
        self,
        preprocess_func: Callable[..., Any] | type | str,
        dataset_meta: DatasetMeta | None = None,
        init_args: Mapping[str, Any] | None = None,
        **map_kwargs: Any,
    ) -> None:
        """Record `preprocess_func` (as `Dataset.map` takes it) to run on each read."""
        self._map_ops.append(make_callable(preprocess_func, Preprocessor, init_args))

    @remote_function(execute="first")
    def encode(self, add_generation_prompt: bool = False, **kwargs: Any) -> None:
        """Encode each row when read.

        Raises ``ValueError`` when no template is set, and for ``truncation_strategy='delete'``
        (a row read by index cannot be dropped).
        """
        if self._require_template().truncation_strategy == "delete":
            raise ValueError(
                "LazyDataset cannot drop rows when they are read; use truncation_strategy "
                "'right', 'left' or 'raise', or an eager Dataset"
            )
        self.do_encode = True
        self.add_generation_prompt = add_generation_prompt

    def __getitem__(self, index: int | slice) -> Row | list[Row]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        row = self.rows[index]
        for fn in self._map_ops:
            row = _apply_to_row(fn, row)
        if self.do_encode:
            template = self._require_template()
            encoded = self._encode_row(template, index, row, self.add_generation_prompt)
            assert encoded is not None  # encode() refused the 'delete' strategy
            row = {**row, **encoded}
        return row
