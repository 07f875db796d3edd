"""`twinkle train`: supervised fine-tuning of a causal LM with the functional core.

With no arguments it trains a tiny random-init Qwen2-style model, with a character tokenizer, on
a generated arithmetic chat set, all offline; `--model` and `--data` point it at a local HF model
directory and a JSONL file instead. `--config run.yaml` describes a run in a file
(`twinkle.cli.config`); flags and ``--set key=value`` override it, in that order.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml
from tqdm import tqdm
from transformers import AutoTokenizer, Qwen2Config

import twinkle_fn as tf
from twinkle.cli import checkpoints as ckpts
from twinkle.cli import config as cfg
from twinkle.cli.metrics import MetricsLog, flops_per_token, memory_gb, peak_flops
from twinkle.cli.report import plot_losses, print_summary
from twinkle_fn.data import (
    arithmetic_dataset,
    char_tokenizer,
    check_supervised,
    encode_rows,
    load_jsonl,
    pack,
    split_features,
    train_heldout_split,
)
from twinkle_fn.distributed import init_distributed, rank, world_size

DEFAULT_WARMUP_STEPS = 20
DEFAULT_MAX_LENGTH = 256
# flag -> config key; a flag given on the command line overrides the config file.
FLAGS = {
    "model": "model.path",
    "data": "data.path",
    "steps": "schedule.steps",
    "batch_size": "data.batch_size",
    "micro_batches": "data.micro_batches",
    "lr": "optimizer.lr",
    "warmup_steps": "schedule.warmup_steps",
    "weight_decay": "optimizer.weight_decay",
    "max_length": "model.max_length",
    "num_samples": "data.num_samples",
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
}


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


def _train_step(
    state: tf.TrainState, feats: list[dict[str, Any]], mesh: tf.Mesh, micro: int, out: Path
) -> tuple[tf.TrainState, dict[str, Any]]:
    """One update from the global batch `feats`: this data rank's slice in `micro`
    accumulated micro-batches, then `tf.step` (donates `state`). Raises ``ValueError`` naming
    the step when the loss or gradient norm is not finite (nothing saved)."""
    grads = None
    local = feats[mesh.get_slice(len(feats), rank())]  # this data rank's
    for part in split_features(local, micro):
        grads, _ = tf.fwd_bwd(state, pack(part), accum=grads)
    try:
        return tf.step(state, grads, on_nonfinite="raise")
    except tf.NonFiniteError as e:
        raise ValueError(
            f"training diverged, stopping without saving (any checkpoint in {out} is left as it "
            f"was): {e}"
        ) from e


def _due(every: int, done: int, steps: int) -> bool:
    """Whether a cadence of `every` steps (0: never) falls after step `done`; the last step
    is left to the end of the run."""
    return bool(every) and done % every == 0 and done < steps


def _save_final(state: tf.TrainState, out: Path, tokenizer: Any, config: cfg.RunConfig) -> Path:
    """``<out>/checkpoint``, and with LoRA ``<out>/adapter`` (what
    ``peft.PeftModel.from_pretrained(base, dir)`` loads). Returns the checkpoint."""
    steps = config.schedule.steps
    if config.lora is not None:
        tf.lora.save_adapter(state, out / "adapter")
    return tf.checkpoint.save(state, out / "checkpoint", tokenizer=tokenizer, extra={"step": steps})


def _save(state: tf.TrainState, path: Path, tokenizer: Any, step: int) -> Path:
    """A checkpoint of `state` at `path` (its ``extra`` holds `step`, the data position)."""
    return tf.checkpoint.save(state, path, tokenizer=tokenizer, extra={"step": step})


def _dist_checkpoint(config: cfg.RunConfig) -> Path | None:
    """``megatron.dist_checkpointing_path`` when ``use_dist_checkpointing``: the checkpoint
    whose weights the run starts from. Raises ``ValueError`` naming it when it is none."""
    meg = config.megatron
    if meg is None or not meg.use_dist_checkpointing:
        return None
    path = Path(meg.dist_checkpointing_path)
    if not tf.checkpoint.is_complete(path):
        raise ValueError(
            f"megatron.dist_checkpointing_path {path}: not a twinkle checkpoint "
            f"({tf.checkpoint.MANIFEST} missing); pass a directory written by twinkle train"
        )
    return path


def _offload(config: cfg.RunConfig) -> dict[str, bool]:
    """What the megatron block parks in host memory between steps."""
    meg = config.megatron
    if meg is None:
        return {"params": False, "grads": False, "optimizer": False}
    return {
        "params": meg.param_offload,
        "grads": meg.grad_offload,
        "optimizer": meg.optimizer_offload,
    }


def _nested(key: str, value: Any) -> dict[str, Any]:
    """``("a.b", v)`` -> ``{"a": {"b": v}}``."""
    *parents, leaf = key.split(".")
    node: dict[str, Any] = {leaf: value}
    for part in reversed(parents):
        node = {part: node}
    return node


def tiny_qwen2_config(vocab_size: int) -> Qwen2Config:
    """The default model: a 4-layer Qwen2 with hidden size 128 (about 0.9M parameters)."""
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )


def _world_mesh(config: cfg.RunConfig) -> tf.Mesh:
    """``mesh`` (or the megatron block's parallel sizes), by default data parallelism over the
    whole world (printed by rank 0 when it has several processes). Raises ``ValueError`` for a
    mesh that does not match the world or the megatron block, and for a batch that leaves a data
    rank fewer samples than micro-batches."""
    meg = config.megatron
    sizes = (
        (meg.tensor_model_parallel_size, meg.pipeline_model_parallel_size)
        if meg is not None
        else (1, 1)
    )
    if config.mesh is not None:
        mesh = _mesh(config.mesh)
        if meg is not None and (mesh.tp, mesh.pp, mesh.ep) != (
            *sizes,
            meg.expert_model_parallel_size,
        ):
            raise ValueError(
                f"mesh {config.mesh} disagrees with the megatron block (tp={sizes[0]}, "
                f"pp={sizes[1]}, ep={meg.expert_model_parallel_size}); give the sizes in one place"
            )
    else:
        tp, pp = sizes
        ep = meg.expert_model_parallel_size if meg is not None else 1
        if world_size() % (tp * pp):
            raise ValueError(
                f"megatron tensor x pipeline parallel size {tp} x {pp} does not divide the "
                f"world of {world_size()} processes; launch a multiple of {tp * pp}"
            )
        mesh = tf.Mesh(dp=world_size() // (tp * pp), tp=tp, pp=pp, ep=ep)
    mesh.validate(world_size())
    if config.mesh is None and world_size() > 1 and rank() == 0:
        print(f"twinkle train: no --mesh given; data parallel over the world: {_sizes(mesh)}")
    batch_size, micro = config.data.batch_size, config.data.micro_batches
    per_rank = batch_size // mesh.data_world_size
    if per_rank < micro:
        raise ValueError(
            f"--batch-size {batch_size} over {mesh.data_world_size} data ranks "
            f"({_sizes(mesh)}) leaves {per_rank} samples per rank, fewer than --micro-batches "
            f"{micro}; raise --batch-size to at least "
            f"{mesh.data_world_size * micro} or lower --micro-batches"
        )
    return mesh


def _sizes(mesh: tf.Mesh) -> str:
    """``"dp=2,tp=2"``: the mesh's axes of size > 1 (``"one process"`` for none)."""
    axes = ("dp", "fsdp", "tp", "pp", "cp", "ep", "etp")
    return ",".join(f"{a}={getattr(mesh, a)}" for a in axes if getattr(mesh, a) > 1) or (
        "one process"
    )


def _optimizer(config: cfg.RunConfig) -> tf.optim.GradientTransformation:
    """AdamW with a warmup-cosine schedule from the lr down to ``min_lr_ratio`` of it, after
    clipping to the global norm ``optimizer.clip_grad``: the core's transforms on the
    transformers backend, megatron's distributed optimizer (the same update) on megatron.

    Raises ``ValueError`` (before anything is built) for an lr that is not a positive finite
    number, a negative or non-finite weight decay, and an explicit warmup that is not shorter
    than the run (it would never reach the lr): the same policy as the library's schedules and
    optimizers, which refuse them too.
    """
    opt = config.optimizer
    if not math.isfinite(opt.weight_decay) or opt.weight_decay < 0:
        raise ValueError(
            f"--weight-decay must be a finite number >= 0, got {opt.weight_decay}; pass e.g. "
            "--weight-decay 0.01 (optimizer.weight_decay in a config)"
        )
    schedule = tf.schedules.warmup_cosine(
        peak_lr=_check_lr(opt.lr),
        warmup_steps=_warmup_steps(config.schedule),
        decay_steps=config.schedule.steps,
        min_lr=opt.lr * config.schedule.min_lr_ratio,
    )
    return OPTIMIZERS[config.backend](schedule, opt.weight_decay, opt.clip_grad)


def _adamw(
    lr: tf.schedules.Schedule, weight_decay: float, clip_grad: float
) -> tf.optim.GradientTransformation:
    """The core's clipping then AdamW (what the transformers backend trains with)."""
    return tf.optim.chain(
        tf.optim.clip_by_global_norm(clip_grad), tf.optim.adamw(lr, weight_decay=weight_decay)
    )


def _megatron_adamw(
    lr: tf.schedules.Schedule, weight_decay: float, clip_grad: float
) -> tf.optim.GradientTransformation:
    """megatron-core's distributed optimizer: the same update, and the only one the megatron
    backend checkpoints and shards over tp / pp."""
    return tf.optim.megatron_optimizer(lr, weight_decay=weight_decay, clip_grad=clip_grad)


# The optimizer each backend trains with.
OPTIMIZERS = {"transformers": _adamw, "megatron": _megatron_adamw}


def _check_lr(lr: float) -> float:
    """`lr`; raises ``ValueError`` unless it is a positive finite number."""
    if not math.isfinite(lr) or lr <= 0:
        raise ValueError(
            f"--lr must be a positive finite number, got {lr}: a learning rate of 0 trains "
            "nothing; pass e.g. --lr 3e-3 (optimizer.lr in a config)"
        )
    return lr


def _warmup_steps(schedule: cfg.ScheduleConfig) -> int:
    """``warmup_steps``, or by default 20 capped to ``steps - 1``. Raises ``ValueError`` for
    an explicit warmup that is not shorter than the run."""
    steps = schedule.steps
    if schedule.warmup_steps is None:
        return min(DEFAULT_WARMUP_STEPS, steps - 1)
    if schedule.warmup_steps >= steps:
        raise ValueError(
            f"--warmup-steps {schedule.warmup_steps} must be < --steps {steps}: the warmup "
            f"would outlast the run and never reach --lr; lower --warmup-steps (e.g. "
            f"{steps // 10}) or raise --steps"
        )
    return schedule.warmup_steps


def _max_length(config: cfg.RunConfig, max_positions: int) -> int:
    """``model.max_length``, or by default `DEFAULT_MAX_LENGTH` capped to `max_positions` (the
    model's ``max_position_embeddings``). Raises ``ValueError`` for an explicit length past
    them: positions the model has no embedding for would train without a word."""
    length = config.model.max_length
    if length is None:
        return min(DEFAULT_MAX_LENGTH, max_positions)
    if length > max_positions:
        raise ValueError(
            f"--max-length {length} exceeds the model's max_position_embeddings "
            f"({max_positions}); pass --max-length {max_positions} or less"
        )
    return length


def _model_and_tokenizer(config: cfg.RunConfig) -> tuple[tf.models.Model, Any]:
    """The model on ``config.backend`` (with its LoRA adapter) and its tokenizer. Raises
    ``ValueError`` for a model directory without a tokenizer."""
    options = dict(config.megatron.override_transformer_config) if config.megatron else {}
    if config.fp8 is not None:
        options["fp8"] = config.fp8
    kwargs = dict(backend=config.backend, precision=config.precision, options=options or None)
    if config.model.path is None:
        tokenizer = char_tokenizer()
        hf_config = tiny_qwen2_config(len(tokenizer))
        hf_config.pad_token_id = tokenizer.pad_token_id
        hf_config.eos_token_id = tokenizer.eos_token_id
        model = tf.models.from_hf_config(hf_config, seed=config.seed, **kwargs)
    else:
        path = tf.models.resolve_model_dir(config.model.path)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise ValueError(
                f"--model {config.model.path}: no tokenizer could be loaded from {path} ({e}); "
                "save the tokenizer into the model directory"
            ) from e
        model = tf.models.from_pretrained(path, **kwargs)
    if config.lora is not None:
        lora = config.lora
        model = tf.lora.add_lora(
            model,
            {
                "r": lora.r,
                "lora_alpha": lora.alpha,
                "target_modules": lora.targets,
                "lora_dropout": lora.dropout,
            },
        )
    return model, tokenizer


def _heldout_loss(state: tf.TrainState, feats: list[dict[str, Any]], batch_size: int) -> float:
    """Token-mean loss over every held-out sample."""
    loss_sum, num_tokens = 0.0, 0
    for i in range(0, len(feats), batch_size):
        out = tf.evaluate(state, pack(feats[i : i + batch_size]))
        loss_sum += float(out.loss_sum)
        num_tokens += int(out.num_tokens)
    return loss_sum / max(num_tokens, 1)


def _sample_order(n: int, total: int, seed: int) -> list[int]:
    """Indices for `total` draws: shuffled epochs over `n` samples, deterministic in `seed`
    (so a resumed run finds its data position from the step alone)."""
    rng = random.Random(seed)
    order: list[int] = []
    while len(order) < total:
        epoch = list(range(n))
        rng.shuffle(epoch)
        order.extend(epoch)
    return order[:total]


def _mesh(text: str) -> tf.Mesh:
    """``"dp=2,tp=2"`` -> ``Mesh(dp=2, tp=2)``. Raises ``ValueError`` naming the text."""
    try:
        sizes = {k.strip(): int(v) for k, v in (part.split("=") for part in text.split(","))}
        return tf.Mesh(**sizes)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"mesh {text!r} is not a mesh; write sizes like fsdp=2 or dp=2,tp=2 ({e})"
        ) from e


def _mesh_flag(text: str) -> str:
    """`--mesh`: checked at parse time, kept as text (the config's form)."""
    try:
        _mesh(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return text


def _lora(text: str) -> dict[str, Any]:
    """``"r=16,alpha=32,targets=all-linear"`` -> the ``lora`` block (keys checked later)."""
    try:
        return {k.strip(): yaml.safe_load(v) for k, v in (p.split("=", 1) for p in text.split(","))}
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"{text!r}: write key=value pairs, e.g. r=16,alpha=32,targets=all-linear"
        ) from e


def _nonnegative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value
