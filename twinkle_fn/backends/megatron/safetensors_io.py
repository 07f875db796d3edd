"""HF safetensors checkpoints: lazy, sliceable reads and sharded writes that ``from_pretrained`` loads.

`SafetensorsReader` maps tensor names to files (``model.safetensors`` or the sharded
``model.safetensors.index.json``) and reads through ``safe_open``'s memory-mapped tensors, so a
tensor-parallel rank can read rows ``[a:b)`` of a tensor without materialising the rest of it
(only the touched pages are read, by one copy to the reader's device). `save_hf` writes a stream of
``(name, tensor)`` pairs as size-bounded shards with the index and ``config.json`` that
transformers expects.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import PretrainedConfig

from twinkle_fn.backends.megatron.bridge import export_buckets

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


class SafetensorsReader:
    """Read-only, lazy access to the tensors of an HF checkpoint directory.

    Opens ``model.safetensors.index.json`` when present, else ``model.safetensors``; files are
    opened on first use and kept open until `close` (or the end of a ``with`` block). Tensors
    read come back on `device` (default the CPU): each read is one copy from the memory-mapped
    file straight to the device, so that what is done with them next (fusing q/k/v, padding the
    vocabulary, checking finiteness) runs there. Raises ``ValueError`` when the directory
    holds neither file.
    """

    def __init__(
        self, directory: str | os.PathLike[str], device: torch.device | str | None = None
    ) -> None:
        self.directory = Path(directory)
        self.device = torch.device(device or "cpu")
        self._handles: dict[Path, Any] = {}
        index, single = self.directory / INDEX_FILE, self.directory / SINGLE_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._files = {name: self.directory / file for name, file in weight_map.items()}
        elif single.is_file():
            self._files = dict.fromkeys(self._open(single).keys(), single)
        else:
            raise ValueError(
                f"{self.directory} holds neither {INDEX_FILE} nor {SINGLE_FILE}; pass the "
                "directory of an HF checkpoint saved with save_pretrained or save_hf"
            )

    def _open(self, path: Path) -> Any:
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt", device="cpu")
        return self._handles[path]

    def _file(self, name: str) -> Any:
        if name not in self._files:
            raise KeyError(f"tensor {name!r} is not in the checkpoint at {self.directory}")
        return self._open(self._files[name])

    def keys(self) -> list[str]:
        """The names of every tensor in the checkpoint."""
        return list(self._files)

    def __contains__(self, name: object) -> bool:
        return name in self._files

    def __len__(self) -> int:
        return len(self._files)

    def shape(self, name: str) -> tuple[int, ...]:
        """The full shape of tensor `name`, read from the file header. Raises ``KeyError``."""
        return tuple(self._file(name).get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        """The whole tensor `name` (on the reader's device). Raises ``KeyError`` if absent."""
        return self._file(name).get_tensor(name).to(self.device)

    def get_rows(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Indices ``[start, stop)`` of tensor `name` along `dim`, everything along other dims.

        Reads only that slice from the file (onto the reader's device). Raises ``KeyError`` if
        `name` is absent and ``ValueError`` if `dim` or the range does not fit the tensor's shape.
        """
        shape = self._file(name).get_slice(name).get_shape()
        if not 0 <= dim < len(shape):
            raise ValueError(f"dim {dim} is out of range for {name!r} of shape {shape}")
        if not 0 <= start <= stop <= shape[dim]:
            raise ValueError(
                f"rows [{start}, {stop}) are out of range for dim {dim} of {name!r} (shape {shape})"
            )
        # A view of the memory-mapped tensor: only the pages of the rows are read, once, by the
        # copy to the device (along dim 0 they are contiguous).
        whole = self._file(name).get_tensor(name)
        return whole.narrow(dim, start, stop - start).to(self.device)

    def close(self) -> None:
        """Release the open files; later reads reopen them."""
        self._handles.clear()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _owned(t: torch.Tensor) -> torch.Tensor:
    # safetensors refuses tensors that share storage (e.g. views of one fused qkv), so a view is
    # copied into storage of its own; tensors that already own their storage are written as is.
    t = t.detach().to("cpu").contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def _is_weight_file(path: Path) -> bool:
    return path.name in (SINGLE_FILE, INDEX_FILE) or bool(_SHARD.fullmatch(path.name))


def save_hf(
    directory: str | os.PathLike[str],
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    hf_config: PretrainedConfig,
    max_shard_bytes: int = 5 * 2**30,
) -> dict[str, str]:
    """Write `named_tensors` as an HF checkpoint that ``from_pretrained`` loads; return its weight map.

    Consumes the stream one shard at a time (at most `max_shard_bytes` per shard, or one larger
    tensor alone): one shard is written as ``model.safetensors``, several as
    ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``. Weight files of
    an earlier save in `directory` are replaced; ``config.json`` comes from `hf_config`.
    Raises ``ValueError`` for a repeated name, an empty stream or `max_shard_bytes` < 1.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()
    partial: list[tuple[Path, list[str], int]] = []
    try:
        for i, bucket in enumerate(export_buckets(named_tensors, max_shard_bytes)):
            tensors: dict[str, torch.Tensor] = {}
            for name, tensor in bucket:
                if name in seen:
                    raise ValueError(
                        f"tensor {name!r} appears twice in the stream; names must be unique"
                    )
                seen.add(name)
                tensors[name] = _owned(tensor)
            path = out / f".partial-{i:05d}.safetensors"
            save_file(tensors, path, metadata={"format": "pt"})
            partial.append((path, list(tensors), sum(t.nbytes for t in tensors.values())))
        if not partial:
            raise ValueError("save_hf got no tensors; pass the (name, tensor) pairs to save")
    except BaseException:
        for path, _, _ in partial:
            path.unlink(missing_ok=True)
        raise
    n = len(partial)
    finals = (
        [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    for stale in out.iterdir():
        if _is_weight_file(stale) and stale.name not in finals:
            stale.unlink()
    weight_map: dict[str, str] = {}
    for (path, names, _), final in zip(partial, finals, strict=True):
        path.replace(out / final)
        weight_map.update(dict.fromkeys(names, final))
    if n > 1:
        index = {
            "metadata": {"total_size": sum(size for _, _, size in partial)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    hf_config.save_pretrained(out)
    return weight_map
