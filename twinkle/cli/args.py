"""Upstream Twinkle's script arguments: ``args = CLI.from_args()`` in its cookbook scripts.

Upstream's scripts take every setting as a flag of their ``.sh`` file (``--model-id``,
``--fsdp-size``, ``--lr``...) and read it from a group of `Args`: ``args.model.model_id``,
``args.infra.fsdp_size``, ``args.optimizer.learning_rate``. A flag that no group knows lands
in ``args.extra`` (``--model-name`` -> ``args.extra['model_name']``).

Sources, later ones winning: the groups' defaults, ``TWINKLE_<KEY>`` environment variables, a
YAML file (``--config run.yaml``, nested by group or flat), then the flags. Keys ignore case and
treat ``-`` and ``_`` alike; ``--no-<flag>`` sets a flag false and a flag without a value sets it
true. A key may also be written with its group's name in front (``--lora-adapter-name``), and
a few fields have upstream's other names (``--lr``, ``--num-gpus``, ``--max-new-tokens``). Each
value is converted to its field's type (``--lr 1e-4`` a float, ``--lora-target-modules
q_proj,v_proj`` a list) and checked against its choices; a value that does not convert raises
``ValueError`` naming the flag, the value and what it takes.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


@dataclass
class ModelArgs:
    """What model to train and how it is built (`model_id`: a local directory or hub id)."""

    model_id: str | None = None
    model_cls: str | None = None
    tokenizer_id: str | None = None
    mixed_precision: Literal["no", "fp8", "fp16", "bf16"] = "bf16"
    strategy: Literal["accelerate", "native_fsdp"] = "accelerate"
    memory_efficient_init: bool = False
    gradient_checkpointing: bool = True
    trust_remote_code: bool = True
    load_weights: bool = True
    recompute_granularity: str | None = "full"
    recompute_method: str | None = "uniform"
    recompute_num_layers: int | None = 1
    recompute_modules: list[str] | None = None
    use_distributed_optimizer: bool = True
    variable_seq_lengths: bool = True
    enable_liger: bool = False
    enable_fused_ce: bool = True


@dataclass
class LoraArgs:
    """The LoRA adapter (`get_lora_args` gives peft's ``LoraConfig`` fields)."""

    use_lora: bool = False
    lora_r: int = 8
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_target_modules: list[str] | None = None
    adapter_name: str = "default"
    lora_path: str | None = None


@dataclass
class DatasetArgs:
    dataset_id: str = ""
    subset_name: str = "default"
    split: str = "train"
    streaming: bool = False
    num_proc: int | None = None
    data_slice: str | None = None
    revision: str | None = None


@dataclass
class TemplateArgs:
    template_cls: str | None = None
    model_id: str | None = None
    max_length: int = 8192
    truncation_strategy: Literal["raise", "left", "right", "split", "delete"] = "raise"
    use_chat_template: bool = True
    enable_thinking: bool = True
    default_system: str | None = None


@dataclass
class TrainingArgs:
    max_steps: int = 200
    num_train_epochs: int | None = None
    batch_size: int = 8
    mini_batch_size: int | None = None
    micro_batch_size: int = 2
    gradient_accumulation_steps: int = 1
    output_dir: str = "./output"
    save_steps: int = 50
    save_total_limit: int | None = None
    log_interval: int = 10
    eval_interval: int | None = None
    eval_samples: int | None = None
    train_samples: int | None = None
    resume_from_checkpoint: str | None = None
    resume_only_model: bool = False
    ignore_data_skip: bool = False
    seed: int = 42
    full_determinism: bool = False
    padding_free: bool = False


@dataclass
class OptimizerArgs:
    optimizer_cls: str = "AdamW"
    learning_rate: float = 1e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0


@dataclass
class SchedulerArgs:
    scheduler_cls: str = "CosineAnnealingLR"
    num_warmup_steps: int = 0
    num_training_steps: int | None = None
    t_max: int | None = None
    eta_min: float = 0.0
    lr_decay_steps: int | None = None
    max_lr: float | None = None


@dataclass
class LossArgs:
    loss_cls: str = "CrossEntropyLoss"
    loss_type: str = "sigmoid"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.1
    sft_weight: float = 1.0
    entropy_coef: float = 0.0
    ignore_index: int = -100


@dataclass
class SamplerArgs:
    sampler_type: str = "vLLMSampler"
    gpu_memory_utilization: float = 0.8
    max_model_len: int | None = None
    tensor_parallel_size: int | None = None
    enable_lora: bool = False
    max_lora_rank: int = 32
    enforce_eager: bool = False


@dataclass
class SamplingArgs:
    max_tokens: int | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    num_samples: int = 1
    logprobs: int | None = None
    seed: int | None = None
    stop: str | None = None


@dataclass
class InfraArgs:
    """How the run is laid out: `mode` (``local``: torchrun; ``ray``) and the mesh sizes."""

    mode: Literal["local", "ray"] = "local"
    nproc_per_node: int = 8
    ncpu_proc_per_node: int = 8
    model_gpus: int | None = None
    sampler_gpus: int | None = None
    ref_model_gpus: int | None = None
    world_size: int | None = None
    dp_size: int | None = None
    fsdp_size: int | None = None
    tp_size: int | None = None
    pp_size: int | None = None
    cp_size: int | None = None
    ep_size: int | None = None
    etp_size: int | None = None
    ep_fsdp_size: int | None = None
    vpp_size: int | None = None
    ulysses_size: int | None = None
    sequence_parallel: bool = False
    lazy_collect: bool = True


@dataclass
class ServerArgs:
    config: str | None = None
    ray_namespace: str = "twinkle_cluster"
    host: str = "0.0.0.0"
    port: int = 8000
    log_level: str = "INFO"


@dataclass
class RLArgs:
    num_generations: int = 8
    advantage_type: str = "GRPOAdvantage"
    advantage_scale: Literal["group", "batch", "none"] = "group"
    reward_fns: list[str] | None = None
    student_model_id: str | None = None
    teacher_model_id: str | None = None
    gkd_beta: float = 0.5
    gkd_temperature: float = 1.0
    gkd_topk: int = 64
    router_replay_mode: Literal["disabled", "R2", "R3"] = "disabled"


@dataclass
class CheckpointArgs:
    save_optimizer: bool = True
    merge_and_sync: bool = True
    platform: str = "GPU"
    lora_sync_dir: str | None = None


@dataclass
class Args:
    """Every group of a script's settings, and ``extra``: the keys no group knows."""

    model: ModelArgs = field(default_factory=ModelArgs)
    lora: LoraArgs = field(default_factory=LoraArgs)
    dataset: DatasetArgs = field(default_factory=DatasetArgs)
    template: TemplateArgs = field(default_factory=TemplateArgs)
    training: TrainingArgs = field(default_factory=TrainingArgs)
    optimizer: OptimizerArgs = field(default_factory=OptimizerArgs)
    scheduler: SchedulerArgs = field(default_factory=SchedulerArgs)
    loss: LossArgs = field(default_factory=LossArgs)
    sampler: SamplerArgs = field(default_factory=SamplerArgs)
    sampling: SamplingArgs = field(default_factory=SamplingArgs)
    infra: InfraArgs = field(default_factory=InfraArgs)
    server: ServerArgs = field(default_factory=ServerArgs)
    rl: RLArgs = field(default_factory=RLArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    extra: dict[str, Any] = field(default_factory=dict)

    def get_lora_args(self) -> dict[str, Any]:
        """peft ``LoraConfig`` keyword arguments: ``target_modules`` (default
        ``'all-linear'``), ``r``, ``lora_alpha``, ``lora_dropout``."""
        return {
            "target_modules": self.lora.lora_target_modules or "all-linear",
            "r": self.lora.lora_r,
            "lora_alpha": self.lora.lora_alpha,
            "lora_dropout": self.lora.lora_dropout,
        }

    def get(self, key: str, default: Any = None) -> Any:
        """The value of `key` in whichever group has it (the first in field order), else
        ``extra[key]``, else `default`."""
        for name in _GROUPS:
            group = getattr(self, name)
            if hasattr(group, key):
                return getattr(group, key)
        return self.extra.get(key, default)

    def to_dict(self) -> dict[str, Any]:
        """Every group's fields (and ``extra``) in one flat mapping."""
        flat: dict[str, Any] = {}
        for name in _GROUPS:
            flat.update(dataclasses.asdict(getattr(self, name)))
        flat.update(self.extra)
        return flat


_GROUPS = tuple(f.name for f in dataclasses.fields(Args) if f.name != "extra")
# A field name two groups share -> the group a bare key sets (``--model-id``, ``--seed``).
_PRIMARY = {"model_id": "model", "seed": "training"}
# upstream's other names of a field
_ALIASES = {
    "lr": "learning_rate",
    "num_gpus": "nproc_per_node",
    "max_new_tokens": "max_tokens",
}
_ENV_PREFIX = "TWINKLE_"


def _normal(key: str) -> str:
    return key.strip().lower().replace("-", "_")


def _field_index() -> dict[str, tuple[str, str]]:
    """Normalised key -> (group, field): bare field names, and ``<group>_<field>``."""
    index: dict[str, tuple[str, str]] = {}
    owners: dict[str, list[str]] = {}
    for group in _GROUPS:
        for f in dataclasses.fields(Args.__dataclass_fields__[group].default_factory()):
            owners.setdefault(f.name, []).append(group)
            index[f"{group}_{f.name}"] = (group, f.name)
    for name, groups in owners.items():
        index.setdefault(name, (_PRIMARY.get(name, groups[0]), name))
    for alias, name in _ALIASES.items():
        index[alias] = index[name]
    return index


_INDEX = _field_index()


def parse_argv(argv: Sequence[str]) -> dict[str, Any]:
    """``['--lr', '1e-4', '--sequence-parallel', '--no-enable-liger', '--x=y']`` ->
    ``{'lr': '1e-4', 'sequence-parallel': True, 'enable-liger': False, 'x': 'y'}``. Raises
    ``ValueError`` for an argument that is not a flag (nor a flag's value)."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--") or len(token) == 2:
            raise ValueError(
                f"argument {token!r} is not a --flag: write every setting as --key value "
                "(e.g. --model-id /path/to/model)"
            )
        key, sep, value = token[2:].partition("=")
        if sep:
            out[key] = value
        elif _normal(key).startswith("no_") and _normal(key)[3:] in _INDEX:
            out[key[3:]] = False
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[key] = argv[i + 1]
            i += 1
        else:
            out[key] = True
        i += 1
    return out


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A YAML mapping nested by group (``{'model': {'model_id': ...}}``) -> flat keys."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}_{key}" if prefix else str(key)
        if isinstance(value, Mapping) and _normal(name) in _GROUPS:
            flat.update(_flatten(value, name))
        else:
            flat[name] = value
    return flat


def _convert(hint: Any, value: Any, where: str) -> Any:
    """`value` (a string from argv or the environment, or a YAML value) as type `hint`.
    Raises ``ValueError`` naming `where`, the value and the type or choices it takes."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
        if type(None) in options:
            return None
        raise ValueError(f"{where}: {value!r} is not allowed here (it needs a value)")
    kind = next(t for t in options if t is not type(None))
    origin = typing.get_origin(kind) or kind
    if origin is Literal:
        choices = typing.get_args(kind)
        if value not in choices:
            raise ValueError(f"{where}: {value!r} is not one of {', '.join(map(repr, choices))}")
        return value
    text = value.strip() if isinstance(value, str) else None
    try:
        if origin is bool:
            if isinstance(value, bool):
                return value
            truth = {"true": True, "yes": True, "on": True, "1": True}
            truth.update({"false": False, "no": False, "off": False, "0": False})
            return truth[(text or "").lower()]
        if origin is int and not isinstance(value, bool):
            number = float(text) if text is not None else value
            if number != int(number):
                raise ValueError
            return int(number)
        if origin is float and not isinstance(value, bool):
            return float(text if text is not None else value)
        if origin is list:
            items = value if isinstance(value, list) else text.split(",")
            return [str(v).strip() for v in items if str(v).strip()]
        if origin is str:
            return str(value)
    except (KeyError, TypeError, ValueError, AttributeError):
        pass
    name = getattr(kind, "__name__", str(kind))
    raise ValueError(f"{where}: {value!r} is not a {name}")


def _auto(value: Any) -> Any:
    """An ``extra`` value from argv: a bool, int or float where it reads as one, else as is."""
    if not isinstance(value, str):
        return value
    low = value.lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


class CLI:
    """Upstream's ``twinkle.cli.CLI``: `from_args` reads a script's settings."""

    @staticmethod
    def from_args(
        argv: Sequence[str] | None = None,
        config_file: str | os.PathLike[str] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> Args:
        """The `Args` of defaults, ``TWINKLE_<KEY>`` variables of `environ` (default
        ``os.environ``), the YAML file `config_file` (or ``--config``), then the flags in
        `argv` (default ``sys.argv[1:]``), later sources winning. Raises ``ValueError`` for
        an argument that is not a flag, a value that does not convert to its field's type
        (naming the flag and the value), and an unreadable ``--config``."""
        args = Args()
        flags = parse_argv(sys.argv[1:] if argv is None else list(argv))
        env = os.environ if environ is None else environ
        config_file = flags.pop("config", config_file)
        _apply(args, {k[len(_ENV_PREFIX) :]: v for k, v in env.items() if _env_key(k)}, "env")
        if config_file:
            _apply(args, _flatten(_read_yaml(Path(config_file))), f"--config {config_file}")
        _apply(args, flags, "flag")
        return args


def _env_key(key: str) -> bool:
    # only the variables that name a field: TWINKLE_* also holds the library's own switches
    return key.startswith(_ENV_PREFIX) and _normal(key[len(_ENV_PREFIX) :]) in _INDEX


def _read_yaml(path: Path) -> Mapping[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: cannot read it as YAML ({e})") from e
    if not isinstance(data, Mapping):
        raise ValueError(f"--config {path}: the top level must be a mapping of keys")
    return data


def _apply(args: Args, values: Mapping[str, Any], source: str) -> None:
    """Set each key of `values` on its group's field (converted), or in ``args.extra``."""
    for key, value in values.items():
        normal = _normal(key)
        where = f"--{key}" if source == "flag" else f"{source}: {key}"
        if normal not in _INDEX:
            args.extra[normal] = value if source.startswith("--config") else _auto(value)
            continue
        group_name, name = _INDEX[normal]
        group = getattr(args, group_name)
        hint = typing.get_type_hints(type(group))[name]
        setattr(group, name, _convert(hint, value, where))
