"""`twinkle rl`: GRPO on a built-in verifiable task, from the command line or a config file.

The loop is `twinkle_fn.grpo.iterations` (the one ``cookbook/grpo.py`` runs): a plain HF model
samples groups of completions with the trainer's weights (``tf.export_weights`` after every
update), the reward is the fraction of digits in the answer to an arithmetic question, and each
step takes PPO epochs of the clipped surrogate with a KL term to the initial policy. Around it,
what `twinkle train` does for SFT: the same checked run description (`RLRunConfig`, a
`twinkle.cli.config.RunConfig` with an ``rl`` block; ``--config``, flags, ``--set``), model,
optimizer, mesh, ``<output>/config.yaml``, ``metrics.jsonl`` (with the reward), periodic and
final checkpoints, resume and stop-on-signal.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from tqdm import tqdm
from transformers import AutoModelForCausalLM

import twinkle_fn as tf
from twinkle.cli import checkpoints as ckpts
from twinkle.cli import config as cfg
from twinkle.cli import train
from twinkle.cli.metrics import MetricsLog, memory_gb
from twinkle.cli.report import print_summary
from twinkle_fn import grpo
from twinkle_fn.distributed import init_distributed, rank

HELD_OUT_PROMPTS = 8
# the sampler's dtype (and the weight stream's) for each training precision: the compute dtype
SAMPLER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# flag -> config key, as `twinkle.cli.train.FLAGS`
FLAGS = {
    "model": "model.path",
    "steps": "schedule.steps",
    "lr": "optimizer.lr",
    "warmup_steps": "schedule.warmup_steps",
    "precision": "precision",
    "seed": "seed",
    "mesh": "mesh",
    "output_dir": "output.dir",
    "backend": "backend",
    "lora": "lora",
    "resume": "resume",
    "save_steps": "cadence.save_steps",
    "keep_last": "cadence.keep_last",
    "eval_steps": "cadence.eval_steps",
    "group_size": "rl.group_size",
    "prompts_per_step": "rl.prompts_per_step",
    "max_new_tokens": "rl.max_new_tokens",
    "ppo_epochs": "rl.ppo_epochs",
    "beta": "rl.beta",
    "epsilon": "rl.epsilon",
    "epsilon_high": "rl.epsilon_high",
}


@dataclass
class RLConfig:
    """The ``rl`` block: `twinkle_fn.grpo.GRPOConfig`'s fields (checked by it)."""

    prompts_per_step: int = 4
    group_size: int = 8
    max_new_tokens: int = 4
    ppo_epochs: int = 2
    beta: float = 0.04
    epsilon: float = 0.2
    epsilon_high: float = 0.28


@dataclass
class RLRunConfig(cfg.RunConfig):
    """`twinkle train`'s run description with an ``rl`` block. `run_config` lays it over
    `RL_DEFAULTS`; the ``data`` block is not read (the task is built in)."""

    rl: RLConfig = field(default_factory=RLConfig)


# Where an RL run's defaults differ from SFT's: a constant lr of 1e-2, 40 iterations. The
# schedule counts GRPO iterations (each takes ``rl.ppo_epochs`` optimizer updates).
RL_DEFAULTS: dict[str, Any] = {
    "optimizer": {"lr": 1e-2, "weight_decay": 0.0},
    "schedule": {"steps": 40, "warmup_steps": 0, "min_lr_ratio": 1.0},
    "output": {"dir": "runs/twinkle-rl"},
}


@dataclass
class Summary:
    """What an RL run reports."""

    model: str
    backend: str
    steps: int
    samples_per_step: int
    wall_s: float
    reward_before: float
    reward_after: float
    train_reward_first: float
    train_reward_last: float
    train_tokens_per_s: float
    sync_gb_per_s: float
    checkpoint: str


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``rl`` subcommand (flags default to None: unset, the config decides)."""
    p = sub.add_parser("rl", help="GRPO on a built-in verifiable task (default: the tiny model)")
    p.add_argument("--config", help="YAML run description (twinkle.cli.rl.RLRunConfig)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--backend", choices=cfg.BACKENDS)
    p.add_argument("--model", help="local HF model directory (default: tiny random Qwen2)")
    p.add_argument("--lora", type=train._lora, help="e.g. r=16,alpha=32,targets=all-linear")
    p.add_argument("--resume", help="'latest' (under --output-dir) or a checkpoint directory")
    p.add_argument("--steps", type=train._positive_int, help="GRPO iterations (default 40)")
    p.add_argument("--lr", type=float, help="learning rate (default 1e-2)")
    p.add_argument("--warmup-steps", type=train._nonnegative_int)
    p.add_argument("--precision", choices=cfg.PRECISIONS)
    p.add_argument("--seed", type=int)
    p.add_argument("--mesh", type=train._mesh_flag, help="parallel sizes under torchrun")
    p.add_argument("--output-dir")
    p.add_argument("--save-steps", type=train._nonnegative_int, help="checkpoint every N steps")
    p.add_argument("--keep-last", type=train._positive_int, help="periodic checkpoints kept")
    p.add_argument("--eval-steps", type=train._nonnegative_int, help="held-out reward every N")
    p.add_argument("--group-size", type=train._positive_int, help="samples per prompt (8)")
    p.add_argument("--prompts-per-step", type=train._positive_int, help="prompts per step (4)")
    p.add_argument("--max-new-tokens", type=train._positive_int, help="completion length (4)")
    p.add_argument("--ppo-epochs", type=train._positive_int, help="updates per rollout batch (2)")
    p.add_argument("--beta", type=float, help="k3 KL weight to the initial policy (0.04)")
    p.add_argument("--epsilon", type=float, help="ratio clip below 1 (0.2)")
    p.add_argument("--epsilon-high", type=float, help="ratio clip above 1 (0.28)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run the GRPO job described by `args`; returns the exit code."""
    try:
        summary = train_rl(run_config(args))
    except ckpts.Stopped:  # asked to stop, checkpoint saved: a clean exit
        return 0
    if rank() == 0:
        print_summary(summary, title="twinkle rl: summary")
    return 0


def run_config(args: argparse.Namespace) -> RLRunConfig:
    """The checked `RLRunConfig` of `args` (``--config``, then flags, then ``--set``). Raises
    ``ValueError`` as `twinkle.cli.config.build`, for a ``data`` block (the task is built in)
    and for an ``rl`` block `twinkle_fn.grpo.GRPOConfig` refuses."""
    raw = cfg.load_yaml(args.config) if args.config else {}
    flags: dict[str, Any] = {}
    for name, key in FLAGS.items():
        value = getattr(args, name)
        if value is not None:
            flags = cfg.merge(flags, train._nested(key, value))
    if args.no_progress:
        flags = cfg.merge(flags, {"output": {"progress": False}})
    merged = cfg.merge(cfg.merge(cfg.merge(RL_DEFAULTS, raw), flags), cfg.parse_set(args.set))
    if "data" in merged:  # RL_DEFAULTS has none: the user gave it
        raise ValueError(
            "twinkle rl trains on its built-in arithmetic task and reads no data block; remove "
            f"data.{{{', '.join(sorted(merged['data'] or {}))}}}"
        )
    config = cfg.build(merged, RLRunConfig)
    train._warmup_steps(config.schedule)  # in the user's units, before `_in_updates` scales it
    _grpo_config(config)  # the rl block's values, checked before anything is built
    return config


def _grpo_config(config: RLRunConfig) -> grpo.GRPOConfig:
    try:
        return grpo.GRPOConfig(**asdict(config.rl))
    except ValueError as e:
        raise ValueError(f"rl block: {e}") from e


def train_rl(config: RLRunConfig) -> Summary:
    """Train `config.schedule.steps` GRPO iterations: held-out reward before, every
    ``cadence.eval_steps`` and after; checkpoints every ``cadence.save_steps`` and at the end
    (or on SIGINT / SIGTERM); a summary in ``<output>/summary.json``."""
    rl = _grpo_config(config)
    samples = rl.prompts_per_step * rl.group_size
    # the global batch `twinkle train`'s checks read: every sample of a step, one micro-batch
    as_batch = dataclasses.replace(config, data=cfg.DataConfig(batch_size=samples))
    tx = train._optimizer(_in_updates(config, rl.ppo_epochs))
    out = Path(config.output.dir)
    resume = ckpts.resume_path(config.resume, out)
    start_dir = train._dist_checkpoint(config)
    init_distributed()
    mesh = train._world_mesh(as_batch)
    model, tokenizer = train._model_and_tokenizer(config)
    out.mkdir(parents=True, exist_ok=True)
    if rank() == 0:
        (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(config), sort_keys=False))

    state = tf.init(model, tx, mesh, seed=config.seed)
    if start_dir is not None:
        tf.checkpoint.load_weights(state, start_dir)
    dtype = SAMPLER_DTYPES[config.precision]
    sampler = _sampler(model.config, dtype)
    grpo.sync(sampler, state, dtype)
    reference = grpo.reference_of(sampler) if rl.beta > 0 else None  # the initial policy
    first = 0
    if resume is not None:
        state = tf.checkpoint.load(state, resume)
        first = int(tf.checkpoint.read_extra(resume)["step"])
        grpo.sync(sampler, state, dtype)
    steps = config.schedule.steps
    held_out = grpo.task_prompts(tokenizer, HELD_OUT_PROMPTS, seed=config.seed + 1)
    prompts = grpo.task_prompts(tokenizer, steps * rl.prompts_per_step, seed=config.seed)

    def held_out_reward() -> float:
        return grpo.mean_reward(sampler, tokenizer, held_out, rl, seed=config.seed)

    before = held_out_reward()
    log = MetricsLog(out, config.output.tensorboard) if rank() == 0 else None
    records: list[dict[str, Any]] = []
    loop = grpo.iterations(
        state,
        sampler,
        tokenizer,
        prompts,
        rl,
        steps,
        seed=config.seed,
        reference=reference,
        sync_dtype=dtype,
        start=first,
    )
    bar = tqdm(
        loop, total=steps - first, desc="rl", unit="step", disable=not config.output.progress
    )
    start = time.perf_counter()
    with ckpts.StopSignals() as stop:
        for state, record in bar:
            done = record["step"]
            records.append(record)
            if log is not None:
                log.write({**record, "memory_gb": memory_gb()})
            bar.set_postfix(reward=f"{record['reward']:.3f}")
            if train._due(config.cadence.eval_steps, done, steps) and log is not None:
                log.write({"step": done, "eval_reward": held_out_reward()})
            stopping = stop.agreed() and done < steps
            if stopping or train._due(config.cadence.save_steps, done, steps):
                train._save(state, ckpts.periodic_dir(out, done), tokenizer, done)
                ckpts.prune(out, config.cadence.keep_last)
            if stopping:
                if log is not None:
                    log.close()
                raise ckpts.Stopped(done)
    wall = time.perf_counter() - start
    after = held_out_reward()
    if log is not None:
        log.write({"step": steps, "eval_reward": after})
        log.close()
    ckpt = train._save_final(state, out, tokenizer, config)
    summary = Summary(
        model=config.model.path or "tiny-qwen2 (random init)",
        backend=config.backend,
        steps=steps,
        samples_per_step=samples,
        wall_s=wall,
        reward_before=before,
        reward_after=after,
        train_reward_first=records[0]["reward"] if records else float("nan"),
        train_reward_last=records[-1]["reward"] if records else float("nan"),
        train_tokens_per_s=_median(r["train_tokens_per_s"] for r in records),
        sync_gb_per_s=_median(r["sync_gb_per_s"] for r in records),
        checkpoint=str(ckpt),
    )
    if rank() == 0:
        (out / "summary.json").write_text(json.dumps(asdict(summary), indent=2))
    return summary


def _in_updates(config: RLRunConfig, ppo_epochs: int) -> RLRunConfig:
    """`config` with its schedule counted in optimizer updates (`ppo_epochs` per iteration)."""
    schedule = config.schedule
    warmup = None if schedule.warmup_steps is None else schedule.warmup_steps * ppo_epochs
    return dataclasses.replace(
        config,
        schedule=dataclasses.replace(
            schedule, steps=schedule.steps * ppo_epochs, warmup_steps=warmup
        ),
    )


def _sampler(config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """The rollout model: a plain HF causal LM of the trainer's architecture on this process's
    device (its weights come from the trainer's stream)."""
    device = torch.device(
        f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    )
    with device:
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def _median(values: Any) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else float("nan")
