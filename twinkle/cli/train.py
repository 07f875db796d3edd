"""`twinkle train`: supervised fine-tuning of a causal LM with the functional core.

With no arguments it trains a tiny random-init Qwen2-style model, with a character tokenizer, on
a generated arithmetic chat set, all offline; `--model` and `--data` point it at a local HF model
directory and a JSONL file instead. `--config run.yaml` describes a run in a file
(`twinkle.cli.config`); flags and ``--set key=value`` override it, in that order.

The parts: `twinkle.cli._flags` (the flags and where each lands in the config),
`twinkle.cli._build` (mesh, model, tokenizer, lengths), `twinkle.cli._optimizer` (AdamW and its
schedule) and `twinkle.cli._steps` (one update, cadences, checkpoints, held-out loss); this
module registers the subcommand, reads the config and runs the loop. `twinkle.cli.rl` reads
those parts through this module.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml
from tqdm import tqdm

import twinkle_fn as tf
from twinkle.cli import checkpoints as ckpts
from twinkle.cli import config as cfg
from twinkle.cli._build import (
    DEFAULT_MAX_LENGTH,
    _dist_checkpoint,
    _max_length,
    _model_and_tokenizer,
    _offload,
    _sizes,
    _world_mesh,
    tiny_qwen2_config,
)
from twinkle.cli._flags import (
    FLAGS,
    _lora,
    _mesh,
    _mesh_flag,
    _nested,
    _nonnegative_int,
    _positive_int,
)
from twinkle.cli._optimizer import (
    DEFAULT_WARMUP_STEPS,
    OPTIMIZERS,
    _adamw,
    _check_lr,
    _megatron_adamw,
    _optimizer,
    _warmup_steps,
)
from twinkle.cli._steps import _due, _heldout_loss, _sample_order, _save, _save_final, _train_step
from twinkle.cli.metrics import MetricsLog, flops_per_token, memory_gb, peak_flops
from twinkle.cli.report import plot_losses, print_summary
from twinkle_fn.data import (
    arithmetic_dataset,
    check_supervised,
    encode_rows,
    load_jsonl,
    train_heldout_split,
)
from twinkle_fn.distributed import init_distributed, rank

# Every name this module had; `twinkle.cli.rl` and the tests read the private helpers through it.
__all__ = [
    "DEFAULT_MAX_LENGTH",
    "DEFAULT_WARMUP_STEPS",
    "FLAGS",
    "OPTIMIZERS",
    "Summary",
    "_adamw",
    "_check_lr",
    "_dist_checkpoint",
    "_due",
    "_heldout_loss",
    "_lora",
    "_max_length",
    "_megatron_adamw",
    "_mesh",
    "_mesh_flag",
    "_model_and_tokenizer",
    "_nested",
    "_nonnegative_int",
    "_offload",
    "_optimizer",
    "_positive_int",
    "_sample_order",
    "_save",
    "_save_final",
    "_sizes",
    "_train_step",
    "_warmup_steps",
    "_world_mesh",
    "add_parser",
    "run",
    "run_config",
    "tiny_qwen2_config",
    "train",
]


@dataclass
class Summary:
    """What a training run reports."""

    model: str
    data: str
    steps: int
    train_samples: int
    heldout_samples: int
    train_tokens: int
    wall_s: float
    tokens_per_s: float
    heldout_loss_before: float
    heldout_loss_after: float
    train_loss_first: float
    train_loss_last: float
    checkpoint: str
    plot: str


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``train`` subcommand (flags default to None: unset, the config decides)."""
    p = sub.add_parser("train", help="train a causal LM (default: a tiny model on built-in data)")
    p.add_argument("--config", help="YAML run description (see twinkle.cli.config.RunConfig)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key, e.g. --set optimizer.lr=1e-3 (applied last)",
    )
    p.add_argument("--backend", choices=cfg.BACKENDS)
    p.add_argument(
        "--lora", type=_lora, help="train a LoRA adapter, e.g. r=16,alpha=32,targets=all-linear"
    )
    p.add_argument("--resume", help="'latest' (under --output-dir) or a checkpoint directory")
    p.add_argument("--model", help="local HF model directory (default: tiny random Qwen2)")
    p.add_argument("--data", help="JSONL file with `messages` or `text` rows (default: arithmetic)")
    p.add_argument("--steps", type=_positive_int)
    p.add_argument("--batch-size", type=_positive_int, help="samples per step (default 32)")
    p.add_argument("--micro-batches", type=_positive_int, help="accumulation steps")
    p.add_argument("--lr", type=float, help="peak learning rate (> 0; default 3e-3)")
    p.add_argument(
        "--warmup-steps",
        type=_nonnegative_int,
        help="linear warmup steps, fewer than --steps (default: 20, or steps - 1 if fewer)",
    )
    p.add_argument("--weight-decay", type=float)
    p.add_argument(
        "--max-length",
        type=_positive_int,
        help="tokens per sample, at most the model's max_position_embeddings (default: "
        f"{DEFAULT_MAX_LENGTH}, capped to it); longer samples are truncated",
    )
    p.add_argument("--num-samples", type=_positive_int, help="built-in data size")
    p.add_argument("--precision", choices=cfg.PRECISIONS)
    p.add_argument("--seed", type=int)
    p.add_argument(
        "--mesh",
        type=_mesh_flag,
        help="parallel sizes under torchrun, e.g. fsdp=2 or dp=2,tp=2; each data rank (dp x "
        "fsdp) trains on its slice of every batch (default: dp over every process, printed at "
        "the start; one process without a launcher)",
    )
    p.add_argument("--output-dir")
    p.add_argument("--save-steps", type=_nonnegative_int, help="checkpoint every N steps")
    p.add_argument("--keep-last", type=_positive_int, help="periodic checkpoints kept")
    p.add_argument("--eval-steps", type=_nonnegative_int, help="held-out loss every N steps")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run the training job described by `args`; returns the exit code."""
    try:
        summary = train(run_config(args))
    except ckpts.Stopped:  # asked to stop, checkpoint saved: a clean exit
        return 0
    if rank() == 0:
        print_summary(summary)
    return 0


def run_config(args: argparse.Namespace) -> cfg.RunConfig:
    """The checked `RunConfig` of `args`: the ``--config`` file, then the flags given, then
    ``--set``. Raises ``ValueError`` as `twinkle.cli.config.build`."""
    raw = cfg.load_yaml(args.config) if args.config else {}
    flags: dict[str, Any] = {}
    for name, key in FLAGS.items():
        value = getattr(args, name)
        if value is not None:
            flags = cfg.merge(flags, _nested(key, value))
    if args.no_progress:
        flags = cfg.merge(flags, {"output": {"progress": False}})
    return cfg.build(cfg.merge(cfg.merge(raw, flags), cfg.parse_set(args.set)))


def train(config: cfg.RunConfig) -> Summary:
    """Train, evaluate before, every ``cadence.eval_steps`` and after, checkpoint every
    ``cadence.save_steps`` and at the end (or on SIGINT / SIGTERM), plot and summarise."""
    tx = _optimizer(config)
    rows = (
        load_jsonl(config.data.path)
        if config.data.path
        else arithmetic_dataset(config.data.num_samples, config.seed)
    )
    out = Path(config.output.dir)
    resume = ckpts.resume_path(config.resume, out)
    start_dir = _dist_checkpoint(config)
    init_distributed()
    mesh = _world_mesh(config)
    model, tokenizer = _model_and_tokenizer(config)
    max_length = _max_length(config, model.config.max_position_embeddings)
    train_rows, heldout_rows = train_heldout_split(rows, seed=config.seed)
    train_feats = encode_rows(tokenizer, train_rows, max_length=max_length)
    heldout_feats = encode_rows(tokenizer, heldout_rows, max_length=max_length)
    check_supervised(train_feats, where=f"training data {config.data.path or 'arithmetic'}")
    batch_size = config.data.batch_size
    if len(train_feats) < batch_size:
        raise ValueError(
            f"--batch-size {batch_size} is larger than the {len(train_feats)} training "
            "samples; lower it or add data"
        )
    out.mkdir(parents=True, exist_ok=True)
    if rank() == 0:
        (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(config), sort_keys=False))

    state = tf.init(model, tx, mesh, seed=config.seed)
    if start_dir is not None:
        tf.checkpoint.load_weights(state, start_dir)
    first = 0
    if resume is not None:
        state = tf.checkpoint.load(state, resume)
        first = int(tf.checkpoint.read_extra(resume)["step"])
    heldout_before = _heldout_loss(state, heldout_feats, batch_size)
    log = MetricsLog(out, config.output.tensorboard) if rank() == 0 else None
    flops = flops_per_token(model.config, max_length)
    peak = peak_flops()

    losses: list[float] = []
    tokens = 0
    steps = config.schedule.steps
    order = _sample_order(len(train_feats), steps * batch_size, config.seed)
    offload = _offload(config)
    parked: tf.Offloaded | None = None
    start = time.perf_counter()
    bar = tqdm(range(first, steps), desc="train", unit="step", disable=not config.output.progress)
    with ckpts.StopSignals() as stop:
        for i in bar:
            if parked is not None:
                state, parked = tf.reload(parked), None
            tic = time.perf_counter()
            batch_feats = [train_feats[j] for j in order[i * batch_size : (i + 1) * batch_size]]
            step_tokens = sum(len(f["input_ids"]) for f in batch_feats)  # every data rank's
            tokens += step_tokens
            state, info = _train_step(state, batch_feats, mesh, config.data.micro_batches, out)
            losses.append(float(info["loss"]))
            done = i + 1
            tok_s = step_tokens / (time.perf_counter() - tic)
            if log is not None:
                log.write(
                    {
                        "step": done,
                        "loss": losses[-1],
                        "grad_norm": float(info["grad_norm"]),
                        "lr": info["lr"],
                        "tokens": step_tokens,
                        "tokens_per_s": tok_s,
                        "mfu": None if peak is None else tok_s * flops / peak,
                        "memory_gb": memory_gb(),
                    }
                )
            bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tok_s:.0f}")
            if _due(config.cadence.eval_steps, done, steps):
                loss = _heldout_loss(state, heldout_feats, batch_size)
                if log is not None:
                    log.write({"step": done, "eval_loss": loss})
            stopping = stop.agreed() and done < steps
            if stopping or _due(config.cadence.save_steps, done, steps):
                _save(state, ckpts.periodic_dir(out, done), tokenizer, done)
                ckpts.prune(out, config.cadence.keep_last)
            if stopping:
                if rank() == 0:
                    print(f"twinkle train: stopped by a signal after step {done}; saved")
                if log is not None:
                    log.close()
                raise ckpts.Stopped(done)
            if any(offload.values()):
                parked, state = tf.offload(state, **offload), None
    if parked is not None:
        state = tf.reload(parked)
    wall = time.perf_counter() - start

    heldout_after = _heldout_loss(state, heldout_feats, batch_size)
    if log is not None:
        log.write({"step": steps, "eval_loss": heldout_after})
        log.close()
    ckpt = _save_final(state, out, tokenizer, config)
    plot = out / "loss.png"
    if rank() == 0 and losses:
        plot_losses(losses, heldout_before, heldout_after, plot)
    summary = Summary(
        model=config.model.path or "tiny-qwen2 (random init)",
        data=config.data.path or "arithmetic (built-in)",
        steps=steps,
        train_samples=len(train_feats),
        heldout_samples=len(heldout_feats),
        train_tokens=tokens,
        wall_s=wall,
        tokens_per_s=tokens / wall if wall else 0.0,
        heldout_loss_before=heldout_before,
        heldout_loss_after=heldout_after,
        train_loss_first=losses[0] if losses else math.nan,
        train_loss_last=sum(losses[-10:]) / len(losses[-10:]) if losses else math.nan,
        checkpoint=str(ckpt),
        plot=str(plot),
    )
    if rank() == 0:
        (out / "summary.json").write_text(json.dumps(asdict(summary), indent=2))
    return summary
