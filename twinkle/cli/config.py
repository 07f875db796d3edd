"""`twinkle train`'s run description: one dataclass tree, read from YAML, flags and ``--set``.

Every source lands in the same tree (`RunConfig`), checked before anything is built: an unknown
key names itself and the nearest known key; a value of the wrong type names its key; the
``megatron`` block (the documents' keys, as written) with ``backend: transformers`` is refused.
`to_dict` is what the run writes next to its checkpoints (``config.yaml``).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

BACKENDS = ("transformers", "megatron")
PRECISIONS = ("fp32", "bf16", "fp16")
# The model option fp8's recipes (twinkle_fn.backends.fp8.RECIPES; the facade names no backend
# module, and a test keeps the two equal).
FP8_RECIPES = ("rowwise", "tensorwise")


@dataclass
class ModelConfig:
    """`path`: a local HF model directory (None: a tiny random-init Qwen2)."""

    path: str | None = None
    max_length: int | None = None


@dataclass
class DataConfig:
    """`path`: a JSONL file of ``messages`` or ``text`` rows (None: built-in arithmetic)."""

    path: str | None = None
    num_samples: int = 8000
    batch_size: int = 32
    micro_batches: int = 1


@dataclass
class OptimizerConfig:
    """AdamW after clipping to the global norm `clip_grad`."""

    lr: float = 3e-3
    weight_decay: float = 0.01
    clip_grad: float = 1.0


@dataclass
class ScheduleConfig:
    """Linear warmup then cosine from ``optimizer.lr`` down to ``min_lr_ratio`` of it."""

    steps: int = 300
    warmup_steps: int | None = None
    min_lr_ratio: float = 0.1


@dataclass
class LoraConfig:
    """A LoRA adapter (peft's ``r``, ``lora_alpha``, ``target_modules``, ``lora_dropout``)."""

    r: int = 16
    alpha: int = 32
    targets: str = "all-linear"
    dropout: float = 0.0


@dataclass
class OutputConfig:
    dir: str = "runs/twinkle-train"
    progress: bool = True
    tensorboard: bool = True


@dataclass
class CadenceConfig:
    """`save_steps` / `eval_steps`: every so many steps (0: only at the end); `keep_last`
    periodic checkpoints are kept."""

    save_steps: int = 0
    keep_last: int = 2
    eval_steps: int = 0


@dataclass
class MegatronConfig:
    """The megatron block of the upstream documents, as written there.

    `use_mbridge` is accepted (the HF <-> megatron bridge is built in);
    `dist_checkpointing_path` (with `use_dist_checkpointing`) is a twinkle checkpoint whose
    weights the run starts from; `override_transformer_config` holds megatron-core
    ``TransformerConfig`` fields (``recompute_granularity``...).
    """

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    param_offload: bool = False
    grad_offload: bool = False
    optimizer_offload: bool = False
    use_mbridge: bool = False
    use_dist_checkpointing: bool = False
    dist_checkpointing_path: str | None = None
    override_transformer_config: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunConfig:
    """Everything one `twinkle train` run needs. `fp8`: None, or one of `FP8_RECIPES`: the
    decoder's linears multiply in float8 (the model option ``fp8``; a CUDA GPU of compute
    capability >= 8.9). `fp8_store_frozen` (with `fp8`): their frozen weights (LoRA bases) are
    stored in float8 too (the model option of that name)."""

    backend: str = "transformers"
    precision: str = "fp32"
    fp8: str | None = None
    fp8_store_frozen: bool = False
    seed: int = 0
    mesh: str | None = None
    resume: str | None = None
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    lora: LoraConfig | None = None
    output: OutputConfig = field(default_factory=OutputConfig)
    cadence: CadenceConfig = field(default_factory=CadenceConfig)
    megatron: MegatronConfig | None = None


def load_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping in the YAML file `path`. Raises ``ValueError`` naming the file when it is
    missing, not YAML, or not a mapping."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: cannot read it as YAML ({e})") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: the top level must be a mapping of keys, not a list")
    return data


def parse_set(items: list[str]) -> dict[str, Any]:
    """``["optimizer.lr=1e-3", "lora.r=8"]`` -> a nested mapping; values are YAML scalars.
    Raises ``ValueError`` for an item without ``=``."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: write key=value, e.g. --set optimizer.lr=1e-3")
        *parents, leaf = key.strip().split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    return out


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`base` with `over` laid on top, nested mappings merged key by key."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def build(raw: dict[str, Any], cls: type[RunConfig] = RunConfig) -> RunConfig:
    """The checked `RunConfig` (or its subclass `cls`, e.g. ``twinkle rl``'s) of the nested
    mapping `raw` (missing keys: defaults).

    Raises ``ValueError`` naming the key for an unknown key (with the nearest known one), a
    value of the wrong type, a backend or precision not offered, and a ``megatron`` block with
    another backend.
    """
    config = _build(cls, raw, "")
    if config.backend not in BACKENDS:
        raise ValueError(f"backend: {config.backend!r} is not one of {', '.join(BACKENDS)}")
    if config.precision not in PRECISIONS:
        raise ValueError(f"precision: {config.precision!r} is not one of {', '.join(PRECISIONS)}")
    if config.fp8 is not None and config.fp8 not in FP8_RECIPES:
        raise ValueError(
            f"fp8: {config.fp8!r} is not one of {', '.join(FP8_RECIPES)}; or null (off)"
        )
    if config.fp8_store_frozen and config.fp8 is None:
        raise ValueError(
            "fp8_store_frozen: true stores the weights of float8 linears; set fp8 too "
            f"({', '.join(FP8_RECIPES)}), or drop it"
        )
    if config.megatron is not None and config.backend != "megatron":
        keys = ", ".join(sorted(raw.get("megatron") or {})) or "(empty)"
        raise ValueError(
            f"the megatron block (megatron.{{{keys}}}) is megatron's and backend is "
            f"{config.backend!r}; set backend: megatron, or remove the megatron block"
        )
    meg = config.megatron
    if meg is not None and meg.use_dist_checkpointing and not meg.dist_checkpointing_path:
        raise ValueError(
            "megatron.use_dist_checkpointing is true but megatron.dist_checkpointing_path is "
            "null; name the checkpoint directory to start from, or set it false"
        )
    return config


def to_dict(config: RunConfig) -> dict[str, Any]:
    """`config` as a plain nested mapping (what ``config.yaml`` holds)."""
    return dataclasses.asdict(config)


def _build(cls: type, raw: Any, where: str) -> Any:
    """An instance of the dataclass `cls` from the mapping `raw` at key path `where`."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where or 'config'}: expected a mapping of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values = {}
    for key, value in raw.items():
        path = f"{where}{key}"
        if key not in names:
            near = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            hint = f"; did you mean {where}{near[0]}?" if near else ""
            raise ValueError(
                f"unknown key {path!r}{hint} (known under {where or 'the top level'}: "
                f"{', '.join(names)})"
            )
        values[key] = _value(hints[key], value, path)
    return cls(**values)


def _value(hint: Any, value: Any, path: str) -> Any:
    """`value` checked (and converted: YAML reads ``3e-3`` as a string) against `hint`."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None:
        if type(None) in options:
            return None
        raise ValueError(f"{path}: null is not allowed here")
    kind = next(t for t in options if t is not type(None))
    if dataclasses.is_dataclass(kind):
        return _build(kind, {} if value is True else value, f"{path}.")
    origin = typing.get_origin(kind) or kind
    try:
        if origin is bool:
            if isinstance(value, bool):
                return value
            raise TypeError
        if origin is int and not isinstance(value, bool):
            if float(value) != int(float(value)):
                raise TypeError
            return int(float(value))
        if origin is float and not isinstance(value, bool):
            return float(value)
        if origin is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        if origin is dict and isinstance(value, dict):
            return dict(value)
    except (TypeError, ValueError):
        pass
    raise ValueError(f"{path}: {value!r} is not of type {getattr(kind, '__name__', kind)}")
