"""`Dataset` and its variants: rows in memory, from local files, or from an HF dataset.

Rows are dicts. As upstream, `Dataset.map` is batched: the function gets a batch in columns
(``{column: [values]}``) and returns columns, which are merged into the batch's rows;
`Dataset.filter` is per row. `Dataset.encode` turns chat rows (``messages``) into features with
the dataset's `Template`. `LazyDataset` defers map and encode to ``__getitem__``,
`IterableDataset` is read by iterating, and `PackingDataset` packs encoded rows into rows of at
most ``template.max_length`` tokens (`twinkle_fn.data.pack_greedy`). Everything is held in memory;
HF ``datasets`` objects and hub ids are read only when that (optional) package is installed.

The parts, by what each does (each name below is importable from here, and the classes also from
upstream's module paths):
- `base`: `Dataset` (rows in memory, `map` / `filter` / `encode` / `mix_dataset` / `save_as`);
  `lazy_dataset`, `iterable_dataset`, `packing_dataset`: its variants
- `_sources`: `DatasetMeta` and reading its rows (memory, files, directories, hub ids)
- `_transforms`: what `map` / `filter` / `set_template` take, made callable (`make_callable`,
  `make_template`), and the batched map
- `_rows`: rows <-> columns; `_save`: the file writers of `save_as`
"""

from twinkle.dataset._rows import Row
from twinkle.dataset._sources import FILE_TYPES, DatasetMeta
from twinkle.dataset._transforms import MAP_BATCH_SIZE, make_callable, make_template
from twinkle.dataset.base import Dataset
from twinkle.dataset.iterable_dataset import IterableDataset
from twinkle.dataset.lazy_dataset import LazyDataset
from twinkle.dataset.packing_dataset import PackingDataset

__all__ = [
    "FILE_TYPES",
    "MAP_BATCH_SIZE",
    "Dataset",
    "DatasetMeta",
    "IterableDataset",
    "LazyDataset",
    "PackingDataset",
    "Row",
    "make_callable",
    "make_template",
]
