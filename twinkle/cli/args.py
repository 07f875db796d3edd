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

This module reads the sources and finds each key's field; the groups are dataclasses in
`twinkle.cli._arg_groups`, and `twinkle.cli._arg_values` converts a value to its field's type.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from twinkle.cli._arg_groups import (
    GROUPS,
    Args,
    CheckpointArgs,
    DatasetArgs,
    InfraArgs,
    LoraArgs,
    LossArgs,
    ModelArgs,
    OptimizerArgs,
    RLArgs,
    SamplerArgs,
    SamplingArgs,
    SchedulerArgs,
    ServerArgs,
    TemplateArgs,
    TrainingArgs,
)
from twinkle.cli._arg_values import auto, convert

__all__ = [
    "CLI",
    "Args",
    "CheckpointArgs",
    "DatasetArgs",
    "InfraArgs",
    "LoraArgs",
    "LossArgs",
    "ModelArgs",
    "OptimizerArgs",
    "RLArgs",
    "SamplerArgs",
    "SamplingArgs",
    "SchedulerArgs",
    "ServerArgs",
    "TemplateArgs",
    "TrainingArgs",
    "parse_argv",
]


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
    for group in GROUPS:
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
        if isinstance(value, Mapping) and _normal(name) in GROUPS:
            flat.update(_flatten(value, name))
        else:
            flat[name] = value
    return flat


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
            args.extra[normal] = value if source.startswith("--config") else auto(value)
            continue
        group_name, name = _INDEX[normal]
        group = getattr(args, group_name)
        hint = typing.get_type_hints(type(group))[name]
        setattr(group, name, convert(hint, value, where))
