"""`Dataset` and its variants: rows in memory, from local files, or from an HF dataset.

Rows are dicts. As upstream, `Dataset.map` is batched: the function gets a batch in columns
(``{column: [values]}``) and returns columns, which are merged into the batch's rows;
`Dataset.filter` is per row. `Dataset.encode` turns chat rows (``messages``) into features with
the dataset's `Template`. `LazyDataset` defers map and encode to ``__getitem__``,
`IterableDataset` is read by iterating, and `PackingDataset` packs encoded rows into rows of at
most ``template.max_length`` tokens (`twinkle_fn.data.pack_greedy`). Everything is held in memory;
HF ``datasets`` objects and hub ids are read only when that (optional) package is installed.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import re
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from torch.utils.data import IterableDataset as TorchIterableDataset

import twinkle.preprocessor
from twinkle.hub import HubOperation
from twinkle.infra import remote_class, remote_function
from twinkle.preprocessor import DataFilter, Preprocessor
from twinkle.template import TEMPLATES, Template
from twinkle_fn.data import pack_greedy, read_text

Row = dict[str, Any]
# datasets.map's default batch size, which upstream keeps
MAP_BATCH_SIZE = 1000
FILE_TYPES = (".jsonl", ".json", ".csv", ".txt")


@dataclasses.dataclass
class DatasetMeta:
    """Where a dataset's rows come from.

    `data`: rows in memory (a list of dicts, a dict of columns, a generator function, or an HF
    ``datasets.Dataset``). Otherwise `dataset_id`: a local ``.jsonl``, ``.json``, ``.csv`` or
    ``.txt`` file or a directory of them, or (with the ``datasets`` package) a hub id taken
    with `subset_name` and `split`. `data_slice`: the row indices to keep, applied after
    loading; indices past the end wrap around, as upstream. Raises ``ValueError`` when neither
    source is given or `data_slice` is not iterable.
    """

    dataset_id: str = ""
    subset_name: str = "default"
    split: str = "train"
    data_slice: Iterable[int] | None = None
    data: Any = None

    def __post_init__(self) -> None:
        self._uid = uuid.uuid4().hex[:8]
        if self.data_slice is not None and not isinstance(self.data_slice, Iterable):
            raise ValueError("data_slice must be an iterable")
        if not self.dataset_id and self.data is None:
            raise ValueError(
                "DatasetMeta needs data=<rows> or dataset_id=<a local file, directory or hub id>"
            )

    def get_id(self) -> str:
        """A key naming this source (unique per instance for in-memory data)."""
        if self.data is not None:
            return f"__memory_{self._uid}__:{self.subset_name}:{self.split}"
        name = self.dataset_id.replace(os.sep, "_").replace(".", "_")
        return f"{name}:{self.subset_name}:{self.split}"


@remote_class(execute="first")
class Dataset:
    """An in-memory list of rows with upstream's transformations.

    Raises ``ValueError`` when the meta names a file that does not exist, is not UTF-8 text
    (naming its line) or has no rows, or a hub dataset while the ``datasets`` package is
    missing; ``HubUnavailableError`` for ``ms://`` ids. Errors about a row (invalid JSON, not
    an object, a missing field at `encode`) name its file and line.
    """

    def __init__(self, dataset_meta: DatasetMeta | None = None, **load_kwargs: Any) -> None:
        self.rows: list[Row] = []
        # Where each row came from (``file:line``, ``data[i]``), for the errors that name a row;
        # dropped when a map changes the row count.
        self._origins: list[str] = []
        # Each source's rows as loaded (upstream's ``datasets``), for `mix_dataset`.
        self.datasets: dict[str, list[Row]] = {}
        self.template: Template | None = None
        if dataset_meta:
            self._add(dataset_meta, load_kwargs)

    @remote_function(execute="first")
    def add_dataset(self, dataset_meta: DatasetMeta, **load_kwargs: Any) -> None:
        """Append the rows of another source."""
        self._add(dataset_meta, load_kwargs)

    def _add(self, dataset_meta: DatasetMeta, load_kwargs: Mapping[str, Any]) -> None:
        rows, origins = _load(dataset_meta, load_kwargs)
        self.datasets[dataset_meta.get_id()] = list(rows)
        aligned = self._aligned()
        self.rows.extend(rows)
        self._origins = [*self._origins, *origins] if aligned else []

    @property
    def dataset(self) -> list[Row]:
        """The rows served (upstream's combined ``datasets.Dataset``)."""
        return self.rows

    @remote_function(execute="first")
    def mix_dataset(self, interleave: bool = True) -> None:
        """Mix the sources added so far: ``interleave`` takes one row of each in turn and stops
        when the first source runs out (upstream's ``interleave_datasets``); otherwise they are
        concatenated, as `add_dataset` already serves them. A no-op with one source.

        Raises ``ValueError`` once `map`, `filter` or `encode` has changed the rows (mix the
        sources first, as upstream's pipeline does).
        """
        sources = list(self.datasets.values())
        if len(sources) <= 1 or not interleave:
            return
        if self.rows != [row for rows in sources for row in rows]:
            raise ValueError(
                "mix_dataset(interleave=True) must come before map/filter/encode: the rows no "
                "longer match the sources added; call mix_dataset right after add_dataset"
            )
        offsets = [sum(len(r) for r in sources[:i]) for i in range(len(sources))]
        shortest = min(len(rows) for rows in sources)
        order = [offsets[s] + i for i in range(shortest) for s in range(len(sources))]
        if self._aligned():
            self._origins = [self._origins[i] for i in order]
        self.rows = [self.rows[i] for i in order]

    @remote_function(execute="first")
    def set_template(self, template_cls: Template | type | str = "Template", **kwargs: Any) -> None:
        """Use a `Template` (an instance, or the class / ``'Template'`` built with `kwargs`)."""
        self.template = make_template(template_cls, **kwargs)

    @remote_function(execute="first")
    def map(
        self,
        preprocess_func: Callable[[dict[str, list[Any]]], Mapping[str, list[Any]] | None]
        | type
        | str,
        dataset_meta: DatasetMeta | None = None,
        init_args: Mapping[str, Any] | None = None,
        **map_kwargs: Any,
    ) -> None:
        """Transform the rows in batches of columns, as upstream's ``datasets.map(batched=True)``.

        `preprocess_func` is a function ``{column: [values]} -> {column: [values]}``, a
        `Preprocessor` instance, a class (built with `init_args`) or the name of one in
        `twinkle.preprocessor`. Its columns are merged into the batch's rows (old columns stay
        unless named in ``remove_columns``); a result with another row count replaces the batch;
        None leaves the batch unchanged. ``batch_size`` (default 1000) is read from
        `map_kwargs`; the meta and the other keyword arguments (``num_proc``...) are accepted and
        unused. Raises ``TypeError`` when the result is not a dict of equal-length lists.
        """
        fn = make_callable(preprocess_func, Preprocessor, init_args)
        remove = map_kwargs.get("remove_columns") or ()
        remove = {remove} if isinstance(remove, str) else set(remove)
        rows = _map_batched(fn, self.rows, map_kwargs.get("batch_size", MAP_BATCH_SIZE), remove)
        if len(rows) != len(self.rows):
            self._origins = []
        self.rows = rows

    @remote_function(execute="first")
    def filter(
        self,
        filter_func: Callable[[Row], bool] | type | str,
        dataset_meta: DatasetMeta | None = None,
        init_args: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Keep the rows for which ``filter_func(row)`` is true.

        `filter_func` is a function, a `DataFilter` instance, a class (built with `init_args`) or
        the name of one in `twinkle.preprocessor`.
        """
        fn = make_callable(filter_func, DataFilter, init_args)
        self._keep([bool(fn(row)) for row in self.rows], self.rows)

    @remote_function(execute="first")
    def encode(self, add_generation_prompt: bool = False, **kwargs: Any) -> None:
        """Encode every row with the template (rows the truncation strategy deletes are dropped).

        Raises ``ValueError`` when no template is set, and the template's errors (a row without
        ``messages``...) naming the row and where it came from (``file:line``).
        """
        template = self._require_template()
        rows = [
            self._encode_row(template, i, row, add_generation_prompt)
            for i, row in enumerate(self.rows)
        ]
        self._keep([row is not None for row in rows], rows)

    def _encode_row(
        self, template: Template, index: int, row: Row, add_generation_prompt: bool
    ) -> Row | None:
        """`template.encode` of row `index`; its ``ValueError`` / ``TypeError`` are raised again
        naming the row (``row 3 (data.jsonl:4): ...``)."""
        try:
            return template.encode(row, add_generation_prompt)
        except (ValueError, TypeError) as e:
            origin = f" ({self._origins[index]})" if self._aligned() else ""
            kind = ValueError if isinstance(e, ValueError) else TypeError
            raise kind(f"row {index}{origin}: {e}") from e

    def _keep(self, keep: list[bool], rows: list[Any]) -> None:
        """The rows become those of `rows` (one per current row) where `keep` is true, with
        their origins."""
        if self._aligned():
            self._origins = [o for o, k in zip(self._origins, keep, strict=True) if k]
        self.rows = [row for row, k in zip(rows, keep, strict=True) if k]

    def _aligned(self) -> bool:
        """Whether `_origins` still names every row (a map that changed the count drops it)."""
        return len(self._origins) == len(self.rows)

    def _require_template(self) -> Template:
        if self.template is None:
            raise ValueError("encode needs a template; call set_template('Template', model_id=...)")
        return self.template

    @remote_function(execute="first")
    def save_as(
        self,
        output_path: str | os.PathLike[str],
        format: str | None = None,
        batch_size: int = 1000,
        mode: str = "immediate",
        **kwargs: Any,
    ) -> None:
        """Write the rows served (after every map, filter and encode) to `output_path`, as
        upstream's ``save_as``: ``'jsonl'`` and ``'json'`` one JSON object per line, ``'csv'``
        a header of the columns then one line per row (a list or dict value as its JSON).
        `format` defaults to the path's extension (``.jsonl``/``.json``/``.csv``; others:
        jsonl). The file is written whole, then renamed into place. `batch_size` is accepted
        (rows are in memory).

        Raises ``ValueError`` for a Dataset without a source, ``'parquet'`` (it needs
        pyarrow, not a dependency), another format, ``mode='training'`` (upstream's write-through while training is not
        provided), and ``TypeError`` for other keyword arguments (upstream passes them to
        ``datasets``' writers).
        """
        if kwargs:
            raise TypeError(f"save_as() got unsupported arguments {sorted(kwargs)}")
        if not self.datasets:
            raise ValueError(
                "No dataset to save: this Dataset has no source; build it with "
                "Dataset(DatasetMeta(...)) or add_dataset(...) first"
            )
        if mode != "immediate":
            raise ValueError(
                f"save_as(mode={mode!r}): only mode='immediate' (write the rows now) is "
                "provided; call save_as after training instead of mode='training'"
            )
        path = Path(output_path)
        fmt = format or _FORMATS.get(path.suffix.lstrip(".").lower(), "jsonl")
        if fmt == "parquet":
            raise ValueError(
                f"save_as({str(path)!r}, format='parquet'): parquet needs pyarrow, which this "
                "build does not depend on; save as jsonl, json or csv"
            )
        if fmt not in ("jsonl", "json", "csv"):
            raise ValueError(f"save_as: Unsupported format {fmt!r}; use jsonl, json or csv")
        rows = list(self) if isinstance(self, TorchIterableDataset) else self[0 : len(self)]
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            with open(staging, "w", encoding="utf-8", newline="") as f:
                if fmt == "csv":
                    _write_csv(f, rows)
                else:
                    f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
            os.replace(staging, path)
        finally:
            staging.unlink(missing_ok=True)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int | slice) -> Row | list[Row]:
        return self.rows[index]


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


@remote_class(execute="first")
class PackingDataset(Dataset):
    """Encoded rows packed into rows of at most ``template.max_length`` tokens (2048 if None).

    After `encode`, `pack_dataset` groups the rows (first-fit decreasing,
    `twinkle_fn.data.pack_greedy`); row ``i`` is then group ``i`` concatenated as upstream:
    token-level lists (``input_ids``, ``labels``, ``attention_mask``, ``position_ids``) are
    joined, positions restarting at 0 for each sample, other fields become lists. The
    `InputProcessor` splits such a row at the restarts and packs it padding-free.
    ``packing_num_proc`` is accepted (packing runs in this process).
    """

    def __init__(
        self, dataset_meta: DatasetMeta | None = None, packing_num_proc: int = 1, **kwargs: Any
    ) -> None:
        super().__init__(dataset_meta, **kwargs)
        self.packing_num_proc = packing_num_proc
        self.packed_idx: list[list[int]] | None = None

    @remote_function(execute="first")
    def pack_dataset(self) -> None:
        """Group the encoded rows into packs.

        Raises ``ValueError`` when no template is set or the rows are not encoded, and
        `pack_greedy`'s error for a row longer than the pack size.
        """
        template = self._require_template()
        if not self.rows or "input_ids" not in self.rows[0]:
            raise ValueError("pack_dataset needs encoded rows; call encode() first")
        self.packed_idx = pack_greedy(self.rows, template.max_length or 2048)

    def _packs(self) -> list[list[int]]:
        if self.packed_idx is None:
            raise RuntimeError("call pack_dataset() before reading a PackingDataset")
        return self.packed_idx

    def __len__(self) -> int:
        return len(self._packs())

    def __getitem__(self, index: int | slice) -> Row | list[Row]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        rows = [self.rows[i] for i in self._packs()[index]]
        out: Row = {}
        for key in rows[0]:
            values = [row[key] for row in rows]
            if isinstance(values[0], list) and values[0] and isinstance(values[0][0], int | float):
                out[key] = [v for value in values for v in value]
            else:
                out[key] = values
        return out


# save_as: a file extension -> its format (upstream's; others are jsonl)
_FORMATS = {"jsonl": "jsonl", "json": "json", "csv": "csv", "parquet": "parquet", "pq": "parquet"}


def _write_csv(f: io.TextIOBase, rows: list[Row]) -> None:
    """`rows` as CSV into `f`: every column any row has, in first-seen order; a list or dict
    value as its JSON, a missing one empty."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    writer = csv.writer(f)
    writer.writerow(columns)
    for row in rows:
        values = [row.get(c, "") for c in columns]
        writer.writerow(
            json.dumps(v, ensure_ascii=False) if isinstance(v, list | dict) else v for v in values
        )


def make_template(template_cls: Template | type | str, **kwargs: Any) -> Template:
    """A `Template` from an instance, a `Template` class, or a class name of
    `twinkle.template.TEMPLATES` (``'Template'``, ``'Qwen3_5Template'``) plus `kwargs`.

    Raises ``ValueError`` for any other name or class.
    """
    if isinstance(template_cls, Template):
        return template_cls
    cls = TEMPLATES.get(template_cls) if isinstance(template_cls, str) else template_cls
    if isinstance(cls, type) and issubclass(cls, Template):
        return cls(**kwargs)
    raise ValueError(
        f"unknown template {template_cls!r}; this build has {', '.join(map(repr, TEMPLATES))} "
        "(each renders with the tokenizer's chat template)"
    )


def make_callable(func: Any, base: type, init_args: Mapping[str, Any] | None) -> Callable:
    """A preprocessor or filter from a callable, a class (built with `init_args`) or the name
    of a class in `twinkle.preprocessor` (upstream's ``construct_class``).

    Raises ``ValueError`` for an unknown name and ``TypeError`` for anything not callable.
    """
    if isinstance(func, str):
        found = getattr(twinkle.preprocessor, func, None)
        if not (isinstance(found, type) and issubclass(found, base)):
            raise ValueError(
                f"{func!r} is not a {base.__name__} in twinkle.preprocessor; pass a function, "
                "a class or an instance"
            )
        func = found
    if isinstance(func, type):
        func = func(**(init_args or {}))
    if not callable(func):
        raise TypeError(f"expected a function (or a class to build one), got {func!r}")
    return func


def _columns(rows: list[Row]) -> dict[str, list[Any]]:
    """`rows` as columns; a key some rows lack is None there (as ``datasets`` fills it)."""
    keys = list(dict.fromkeys(k for row in rows for k in row))
    return {k: [row.get(k) for row in rows] for k in keys}


def _rows_of(columns: Any, where: str) -> list[Row]:
    if not isinstance(columns, Mapping):
        raise TypeError(
            f"{where} returned a {type(columns).__name__}, expected a dict of columns "
            "({column: [values]}; map is batched, as upstream's)"
        )
    lengths = {k: len(v) for k, v in columns.items() if isinstance(v, list | tuple)}
    if len(lengths) != len(columns) or len(set(lengths.values())) > 1:
        raise TypeError(f"{where} must return a dict of equal-length lists, got lengths {lengths}")
    count = next(iter(lengths.values()), 0)
    return [{k: columns[k][i] for k in columns} for i in range(count)]


def _map_batched(fn: Callable, rows: list[Row], batch_size: int, remove: set[str]) -> list[Row]:
    out: list[Row] = []
    for start in range(0, len(rows), max(1, batch_size)):
        batch = rows[start : start + max(1, batch_size)]
        result = fn(_columns(batch))
        if result is None:
            out.extend(batch)
            continue
        new = _rows_of(result, f"map: the function (on rows {start}..)")
        if len(new) != len(batch):
            out.extend(new)
            continue
        for old, row in zip(batch, new, strict=True):
            out.append({**{k: v for k, v in old.items() if k not in remove}, **row})
    return out


def _apply_to_row(fn: Callable, row: Row) -> Row:
    """One row through a recorded map: ``preprocess`` for a `Preprocessor`, else a one-row
    batch of columns."""
    if hasattr(fn, "preprocess"):
        return dict(fn.preprocess(row))
    new = _rows_of(fn({k: [v] for k, v in row.items()}), "map: the function")
    if len(new) != 1:
        raise ValueError(f"a LazyDataset map must return one row per row, got {len(new)}")
    return new[0]


def _load(meta: DatasetMeta, load_kwargs: Mapping[str, Any]) -> tuple[list[Row], list[str]]:
    """The rows of `meta` and where each came from (``file:line``, ``data[i]``, ``id[i]``)."""
    if not isinstance(meta, DatasetMeta):
        raise TypeError(f"dataset_meta must be a DatasetMeta, got {type(meta).__name__}")
    if meta.data is not None:
        rows = _rows(meta.data)
        origins = [f"DatasetMeta.data[{i}]" for i in range(len(rows))]
    else:
        rows, origins = _from_id(meta, load_kwargs)
    if meta.data_slice is not None and rows:
        picked = [i % len(rows) for i in meta.data_slice]
        rows, origins = [rows[i] for i in picked], [origins[i] for i in picked]
    return rows, origins


def _rows(data: Any) -> list[Row]:
    if isinstance(data, Mapping):
        return _rows_of(dict(data), "DatasetMeta.data (a dict of columns)")
    if callable(data):
        data = data()
    if not isinstance(data, Iterable):
        raise TypeError(
            f"DatasetMeta.data must be rows, columns or a generator function, got "
            f"{type(data).__name__}"
        )
    rows = [dict(r) if isinstance(r, Mapping) else r for r in data]
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise TypeError(f"DatasetMeta.data[{i}] must be a dict, got {type(row).__name__}")
    return rows


def _from_id(meta: DatasetMeta, load_kwargs: Mapping[str, Any]) -> tuple[list[Row], list[str]]:
    path = Path(os.path.expanduser(meta.dataset_id))
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in FILE_TYPES)
        if not files:
            raise ValueError(f"directory {path} has no {', '.join(FILE_TYPES)} files")
        read = [_read_file(file) for file in files]
        return [r for rows, _ in read for r in rows], [o for _, origins in read for o in origins]
    if path.suffix in FILE_TYPES:
        if not path.is_file():
            raise ValueError(f"dataset file {path} does not exist")
        return _read_file(path)
    loaded = HubOperation.load_dataset(
        meta.dataset_id, meta.subset_name, meta.split, **dict(load_kwargs)
    )
    rows = _rows(loaded)
    return rows, [f"{meta.dataset_id}[{i}]" for i in range(len(rows))]


def _read_file(path: Path) -> tuple[list[Row], list[str]]:
    """The rows of a local file, by extension, as upstream's ``datasets`` loaders read them,
    and where each starts (``file:line``; ``file[i]`` for a JSON document).

    Raises ``ValueError`` naming the file (and line) for bytes that are not UTF-8, invalid
    JSON lines, and a file without rows.
    """
    text = read_text(path)
    if path.suffix == ".csv":
        reader = csv.DictReader(io.StringIO(text, newline=""))
        found = [(dict(row), f"{path}:{reader.line_num}") for row in reader]
        rows, origins = _typed_csv([row for row, _ in found]), [origin for _, origin in found]
    elif path.suffix == ".txt":
        lines = io.StringIO(text, newline=None)
        rows = [{"text": line.rstrip("\n")} for line in lines]
        origins = [f"{path}:{n}" for n in range(1, len(rows) + 1)]
    else:
        rows, origins = _json_rows(text, path)
    if not rows:
        raise ValueError(
            f"dataset file {path} has no rows (it is empty or blank); add rows or leave the "
            "file out"
        )
    return rows, origins


_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|[+-]?(inf|nan)", re.IGNORECASE)


def _typed_csv(rows: list[Row]) -> list[Row]:
    """`rows` of csv strings with each column typed as upstream's loader (pandas, with
    ``na_filter=False``) types it: int when every value is an integer, float when every value
    is a number, else the strings as written (an empty cell keeps its column strings)."""
    for column in rows[0] if rows else ():
        values = [row[column] for row in rows]
        if all(isinstance(v, str) and _INT.fullmatch(v.strip()) for v in values):
            cast: Callable[[str], Any] = int
        elif all(isinstance(v, str) and _FLOAT.fullmatch(v.strip()) for v in values):
            cast = float
        else:
            continue
        for row in rows:
            row[column] = cast(row[column])
    return rows


def _json_rows(text: str, path: Path) -> tuple[list[Row], list[str]]:
    """A ``.json`` file's rows (a list of rows, a dict of columns, or JSON lines), or a
    ``.jsonl`` file's."""
    if path.suffix == ".json":
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None  # not one document: JSON lines, which the json loader also reads
        if isinstance(whole, list):
            rows = _rows(whole)
            return rows, [f"{path}[{i}]" for i in range(len(rows))]
        if isinstance(whole, dict):
            rows = _rows_of(whole, f"{path} (a dict of columns)")
            return rows, [f"{path}[{i}]" for i in range(len(rows))]
    return _json_lines(text, path)


def _json_lines(text: str, path: Path) -> tuple[list[Row], list[str]]:
    rows, origins = [], []
    # split at "\n" only: str.splitlines would also split inside a JSON string at U+2028 etc.
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from e
        if not isinstance(row, dict):
            raise TypeError(
                f'{path}:{lineno}: a row must be a JSON object ({{"field": value, ...}}), got '
                f"{type(row).__name__}"
            )
        rows.append(row)
        origins.append(f"{path}:{lineno}")
    return rows, origins
