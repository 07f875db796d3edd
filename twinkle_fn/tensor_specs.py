"""What a load will read, checked before it writes: tensor names, shapes, dtypes and finiteness.

A load into a live train state must refuse a checkpoint of another model (another hidden size,
another family with the same tensor names, a missing or extra tensor, another dtype) and a
damaged one (truncated files, NaN bytes) before it writes a single element, with an error that
names the tensor, the expected and the found shape or dtype, and the file. `safetensors_specs`
reads the headers of a directory's safetensors files (no tensor data) and checks that every
tensor's bytes lie inside its file; `check_specs` compares them with what the model expects
(each backend lists that: `twinkle_fn.backends.base.Backend.hf_specs`); `check_finite` refuses
NaN and infinity in tensors already read; `dcp_specs` reads a torch.distributed.checkpoint's
metadata.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

# safetensors' dtype names (https://github.com/huggingface/safetensors, format.md)
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_HEADER_LIMIT = 100_000_000  # safetensors' own bound on the JSON header


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor's whole shape and dtype, and where it was found (None: what a model expects)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    file: Path | None = None

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        """The spec of `tensor` (a DTensor's global shape)."""
        return cls(tuple(tensor.shape), tensor.dtype)


def safetensors_specs(
    directory: str | os.PathLike[str], rename: Callable[[str], str] | None = None
) -> dict[str, TensorSpec]:
    """Every tensor of the ``*.safetensors`` files in `directory`, by `rename` of its key, read
    from the file headers alone.

    Raises ``ValueError`` naming the file when `directory` holds no safetensors file, a header
    is unreadable, a tensor's bytes run past the end of its file (a truncated copy), its byte
    count does not match its shape and dtype, or a key appears in two files.
    """
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory} holds no .safetensors weights")
    rename = rename or (lambda key: key)
    specs: dict[str, TensorSpec] = {}
    for file in files:
        for key, spec in _header(file).items():
            name = rename(key)
            if name in specs:
                raise ValueError(
                    f"tensor {key!r} is in both {specs[name].file} and {file}; remove the "
                    "stale file from the checkpoint directory"
                )
            specs[name] = spec
    return specs


def _header(file: Path) -> dict[str, TensorSpec]:
    """The tensors a safetensors `file` declares, each checked to lie inside the file."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if length is None or length > min(size - 8, _HEADER_LIMIT):
            raise ValueError(
                f"{file} is not a complete safetensors file (its {size} bytes do not hold the "
                "header it announces); the file is truncated or corrupt: copy it again"
            )
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{file}: unreadable safetensors header ({err})") from None
    data = size - 8 - length
    out = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        dtype = _DTYPES.get(entry.get("dtype"))
        shape = tuple(entry.get("shape", ()))
        start, end = entry.get("data_offsets", (0, -1))
        if dtype is None:
            raise ValueError(f"{file}: tensor {key!r} has unknown dtype {entry.get('dtype')!r}")
        if end > data:
            raise ValueError(
                f"{file}: tensor {key!r} needs bytes up to {end} of the data section, which "
                f"holds {data}: the file is truncated; copy it again or re-save the checkpoint"
            )
        nbytes = dtype.itemsize * _numel(shape)
        if end - start != nbytes:
            raise ValueError(
                f"{file}: tensor {key!r} of shape {shape} and dtype {dtype} takes {nbytes} bytes, "
                f"its header gives {end - start}: the file is corrupt"
            )
        out[key] = TensorSpec(shape, dtype, file)
    return out


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_specs(
    found: Mapping[str, TensorSpec],
    expected: Mapping[str, TensorSpec],
    *,
    where: str,
    optional: Iterable[str] = (),
    cast: bool = False,
) -> None:
    """Refuse `found` (what a checkpoint at `where` holds) unless it holds every tensor of
    `expected`, nothing else (names in `optional` may be present or not), each with the
    expected shape and dtype; with `cast`, any floating dtype stands for a floating one (a
    bfloat16 release loads into float32 master weights).

    Raises ``ValueError`` naming the tensor, the expected and found shape or dtype, and the file.
    """
    optional = set(optional)
    missing = sorted(set(expected) - set(found) - optional)
    if missing:
        raise ValueError(
            f"{where} lacks {len(missing)} tensors the model has, e.g. {missing[:3]}; it is a "
            "checkpoint of another model (or an incomplete copy): load one saved from this model"
        )
    extra = sorted(set(found) - set(expected) - optional)
    if extra:
        raise ValueError(
            f"{where} holds {len(extra)} tensors the model lacks, e.g. {extra[:3]} (in "
            f"{found[extra[0]].file}); it is a checkpoint of another model or family"
        )
    for name, want in expected.items():
        got = found.get(name)
        if got is None:
            continue
        if got.shape != want.shape:
            raise ValueError(
                f"{where}: tensor {name!r} has shape {got.shape} in {got.file}, the model "
                f"expects {want.shape}; it is a checkpoint of another model size or family"
            )
        same_kind = cast and got.dtype.is_floating_point and want.dtype.is_floating_point
        if got.dtype != want.dtype and not same_kind:
            raise ValueError(
                f"{where}: tensor {name!r} is {got.dtype} in {got.file}, the model expects "
                f"{want.dtype}; load a checkpoint saved from this model"
            )


def nonfinite(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """The name of the first floating tensor of `tensors` holding NaN or infinity (a DTensor's
    local shard is read), or None.

    Each tensor is checked where it lives and the flags are read back once per device: one
    host sync for a whole model on a GPU, not one per tensor. The check is a sum: a NaN or an
    infinity makes it non-finite, so a finite sum proves the tensor finite in one reduction
    (no boolean temporary); the rare non-finite sum of finite values (an overflow) is told
    apart by an element-wise check of that tensor.
    """
    sums: dict[torch.device, list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        local = getattr(tensor, "to_local", lambda t=tensor: t)()
        if local.dtype.is_floating_point:
            flag = torch.isfinite(local.sum())
            sums.setdefault(local.device, []).append((name, local, flag))
    bad = set()
    for entries in sums.values():
        finite = torch.stack([flag for _, _, flag in entries]).tolist()
        for (name, local, _), ok in zip(entries, finite, strict=True):
            if not ok and not bool(torch.isfinite(local).all()):
                bad.add(name)
    return next((name for name in tensors if name in bad), None)


def check_finite(
    tensors: Mapping[str, torch.Tensor],
    *,
    where: str,
    files: Mapping[str, TensorSpec] | None = None,
    device: torch.device | None = None,
) -> None:
    """Raise ``ValueError`` naming the first tensor of `tensors` (read from `where`; `files`
    gives each name's file when known) that holds NaN or infinity.

    On several ranks every rank must call it (each checks its own tensors): the ranks agree
    through one all-reduce of a flag on `device` (the state's device: NCCL reduces device
    tensors only), so that every rank refuses, or none, and none goes on to write alone.
    """
    bad = nonfinite(tensors)
    found = torch.tensor([0 if bad is None else 1], dtype=torch.int32, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
    if bad is not None:
        spec = (files or {}).get(bad)
        file = f" in {spec.file}" if spec is not None and spec.file is not None else ""
        raise ValueError(
            f"{where}: tensor {bad!r}{file} holds NaN or infinity (corrupt bytes, or saved from "
            "a diverged run); load the last good checkpoint"
        )
    if int(found):
        raise ValueError(
            f"{where}: another rank found a tensor holding NaN or infinity (its error names "
            "it); load the last good checkpoint"
        )


def module_specs(module: torch.nn.Module) -> tuple[dict[str, TensorSpec], frozenset[str]]:
    """The tensors `module`'s ``state_dict`` holds (whole shapes, dtypes) and the names that are
    aliases of an earlier one (tied weights: a checkpoint may hold them or not)."""
    specs: dict[str, TensorSpec] = {}
    seen: set[int] = set()
    aliases = set()
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            aliases.add(name)
        seen.add(id(tensor))
        specs[name] = TensorSpec.of(tensor)
    return specs, frozenset(aliases)


def dcp_specs(directory: str | os.PathLike[str]) -> dict[str, TensorSpec]:
    """The tensors of the torch.distributed.checkpoint at `directory` (flattened keys, whole
    shapes, dtypes), read from its metadata alone. Raises ``ValueError`` when it has none."""
    try:
        metadata = dcp.FileSystemReader(os.fspath(directory)).read_metadata()
    except (OSError, ValueError, RuntimeError) as err:
        raise ValueError(f"{directory}: unreadable checkpoint metadata ({err})") from None
    return {
        key: TensorSpec(tuple(meta.size), meta.properties.dtype, Path(directory))
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
