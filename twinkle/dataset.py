"""`Dataset` and `DatasetMeta`: rows in memory, from a JSON-lines file, or from an HF dataset.

Rows are dicts. `Dataset.map`/`filter` transform them eagerly; `Dataset.encode` turns chat rows
(``messages``) into features with the dataset's `Template`. HF ``datasets`` objects are read
only when that (optional) package is installed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from twinkle.infra import remote_class, remote_function
from twinkle.template import Template
from twinkle_fn.data import load_jsonl

Row = dict[str, Any]


@dataclasses.dataclass
class DatasetMeta:
    """Where a dataset's rows come from.

    `data`: rows in memory (a list or any iterable of dicts, or an HF ``datasets.Dataset``).
    Otherwise `dataset_id`: a ``.jsonl`` file (chat ``messages`` or ``text`` rows, see
    `twinkle_fn.data.load_jsonl`), or, with the ``datasets`` package installed, anything
    ``datasets.load_dataset`` takes (with `subset_name` and `split`). `data_slice`: the row
    indices to keep (a range or list), applied after loading.
    """

    dataset_id: str = ""
    subset_name: str = "default"
    split: str = "train"
    data_slice: Iterable[int] | None = None
    data: Any = None


@remote_class(execute="first")
class Dataset:
    """An in-memory list of rows with upstream's transformations.

    Raises ``ValueError`` when the meta names no source, a file that does not exist, or a hub
    dataset while the ``datasets`` package is missing.
    """

    def __init__(self, dataset_meta: DatasetMeta | None = None, **load_kwargs: Any) -> None:
        self.rows: list[Row] = _load(dataset_meta, load_kwargs) if dataset_meta else []
        self.template: Template | None = None

    @remote_function(execute="first")
    def add_dataset(self, dataset_meta: DatasetMeta, **load_kwargs: Any) -> None:
        """Append the rows of another source."""
        self.rows.extend(_load(dataset_meta, load_kwargs))

    @remote_function(execute="first")
    def set_template(self, template_cls: Template | type | str = "Template", **kwargs: Any) -> None:
        """Use a `Template` (an instance, or the class / ``'Template'`` built with `kwargs`)."""
        self.template = make_template(template_cls, **kwargs)

    @remote_function(execute="first")
    def map(
        self,
        preprocess_func: Callable[[Row], Row | None],
        dataset_meta: DatasetMeta | None = None,
        init_args: Mapping[str, Any] | None = None,
        **map_kwargs: Any,
    ) -> None:
        """Replace each row by ``preprocess_func(row)``; rows it maps to None are dropped.

        A class is instantiated with `init_args` first (upstream's preprocessor classes). The
        meta and other keyword arguments of upstream (``num_proc``...) are accepted and unused.
        Raises ``TypeError`` when the result is not a dict.
        """
        fn = (
            preprocess_func(**(init_args or {}))
            if isinstance(preprocess_func, type)
            else preprocess_func
        )
        if not callable(fn):
            raise TypeError(
                f"map needs a function row -> row (or a class to build one), got {preprocess_func!r}"
            )
        out = []
        for i, row in enumerate(self.rows):
            new = fn(row)
            if new is None:
                continue
            if not isinstance(new, Mapping):
                raise TypeError(
                    f"map: the function returned a {type(new).__name__} for row {i}, expected a dict"
                )
            out.append(dict(new))
        self.rows = out

    @remote_function(execute="first")
    def filter(self, filter_func: Callable[[Row], bool], **kwargs: Any) -> None:
        """Keep the rows for which ``filter_func(row)`` is true."""
        self.rows = [row for row in self.rows if filter_func(row)]

    @remote_function(execute="first")
    def encode(self, add_generation_prompt: bool = False, **kwargs: Any) -> None:
        """Encode every row with the template (rows the truncation strategy deletes are dropped).

        Raises ``ValueError`` when no template is set, and the template's errors.
        """
        if self.template is None:
            raise ValueError("encode needs a template; call set_template('Template', model_id=...)")
        self.rows = self.template.batch_encode(self.rows, add_generation_prompt)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int | slice) -> Row | list[Row]:
        return self.rows[index]


def make_template(template_cls: Template | type | str, **kwargs: Any) -> Template:
    """A `Template` from an instance, the class, or the name ``'Template'`` plus `kwargs`.

    Raises ``ValueError`` for any other name or class.
    """
    if isinstance(template_cls, Template):
        return template_cls
    if template_cls in ("Template", Template):
        return Template(**kwargs)
    raise ValueError(
        f"unknown template {template_cls!r}; this build has 'Template' (any tokenizer with a "
        "chat template)"
    )


def _load(meta: DatasetMeta, load_kwargs: Mapping[str, Any]) -> list[Row]:
    if not isinstance(meta, DatasetMeta):
        raise TypeError(f"dataset_meta must be a DatasetMeta, got {type(meta).__name__}")
    if meta.data is not None:
        rows = _rows(meta.data)
    elif meta.dataset_id:
        rows = _from_id(meta, load_kwargs)
    else:
        raise ValueError("DatasetMeta needs data=<rows> or dataset_id=<a .jsonl file or hub id>")
    if meta.data_slice is not None:
        rows = [rows[i] for i in meta.data_slice]
    return rows


def _rows(data: Any) -> list[Row]:
    if isinstance(data, Mapping) or not isinstance(data, Iterable):
        raise TypeError(
            f"DatasetMeta.data must be an iterable of dict rows, got {type(data).__name__}"
        )
    rows = [dict(r) if isinstance(r, Mapping) else r for r in data]
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise TypeError(f"DatasetMeta.data[{i}] must be a dict, got {type(row).__name__}")
    return rows


def _from_id(meta: DatasetMeta, load_kwargs: Mapping[str, Any]) -> list[Row]:
    path = Path(os.path.expanduser(meta.dataset_id))
    if path.suffix in (".jsonl", ".json"):
        if not path.is_file():
            raise ValueError(f"dataset file {path} does not exist")
        return load_jsonl(path)
    if importlib.util.find_spec("datasets") is None:
        raise ValueError(
            f"dataset_id={meta.dataset_id!r} is not a .jsonl file, and loading hub datasets needs "
            "the `datasets` package (pip install datasets); or pass rows as DatasetMeta(data=...)"
        )
    import datasets

    name = None if meta.subset_name == "default" else meta.subset_name
    loaded = datasets.load_dataset(
        meta.dataset_id.removeprefix("hf://"), name, split=meta.split, **load_kwargs
    )
    return _rows(loaded)
