"""`Dataset`: an in-memory list of rows with upstream's transformations (`map`, `filter`,
`encode`, `mix_dataset`, `save_as`); upstream's ``twinkle.dataset.base``."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch.utils.data import IterableDataset as TorchIterableDataset

from twinkle.dataset._rows import Row
from twinkle.dataset._save import _FORMATS, _write_csv
from twinkle.dataset._sources import DatasetMeta, _load
from twinkle.dataset._transforms import MAP_BATCH_SIZE, _map_batched, make_callable, make_template
from twinkle.infra import remote_class, remote_function
from twinkle.preprocessor import DataFilter, Preprocessor
from twinkle.template import Template


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
