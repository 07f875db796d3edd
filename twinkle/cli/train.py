"""`twinkle train`: supervised fine-tuning of a causal LM with the functional core.

With no arguments it trains a tiny random-init Qwen2-style model, with a character tokenizer, on
a generated arithmetic chat set, all offline; `--model` and `--data` point it at a local HF model
directory and a JSONL file instead.
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

from tqdm import tqdm
from transformers import AutoTokenizer, Qwen2Config

import twinkle_fn as tf
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
    """Register the ``train`` subcommand."""
    p = sub.add_parser("train", help="train a causal LM (default: a tiny model on built-in data)")
    p.add_argument("--model", help="local HF model directory (default: tiny random Qwen2)")
    p.add_argument("--data", help="JSONL file with `messages` or `text` rows (default: arithmetic)")
    p.add_argument("--steps", type=_positive_int, default=300)
    p.add_argument("--batch-size", type=_positive_int, default=32, help="samples per step")
    p.add_argument("--micro-batches", type=_positive_int, default=1, help="accumulation steps")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (> 0)")
    p.add_argument(
        "--warmup-steps",
        type=_nonnegative_int,
        default=None,
        help="linear warmup steps, fewer than --steps (default: 20, or steps - 1 if fewer)",
    )
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument(
        "--max-length",
        type=_positive_int,
        default=None,
        help="tokens per sample, at most the model's max_position_embeddings (default: "
        f"{DEFAULT_MAX_LENGTH}, capped to it); longer samples are truncated",
    )
    p.add_argument("--num-samples", type=_positive_int, default=8000, help="built-in data size")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--mesh",
        type=_mesh,
        default=None,
        help="parallel sizes under torchrun, e.g. fsdp=2 or dp=2,tp=2; each data rank (dp x "
        "fsdp) trains on its slice of every batch (default: dp over every process, printed at "
        "the start; one process without a launcher)",
    )
    p.add_argument("--output-dir", default="runs/twinkle-train")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run the training job described by `args`; returns the exit code."""
    summary = train(args)
    if rank() == 0:
        print_summary(summary)
    return 0


def train(args: argparse.Namespace) -> Summary:
    """Train, evaluate before and after, save a checkpoint, plot and summarise."""
    tx = _optimizer(args)
    rows = load_jsonl(args.data) if args.data else arithmetic_dataset(args.num_samples, args.seed)
    init_distributed()
    mesh = _world_mesh(args)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = _model_and_tokenizer(args)
    max_length = _max_length(args, model.config.max_position_embeddings)
    train_rows, heldout_rows = train_heldout_split(rows, seed=args.seed)
    train_feats = encode_rows(tokenizer, train_rows, max_length=max_length)
    heldout_feats = encode_rows(tokenizer, heldout_rows, max_length=max_length)
    check_supervised(train_feats, where=f"training data {args.data or 'arithmetic'}")
    if len(train_feats) < args.batch_size:
        raise ValueError(
            f"--batch-size {args.batch_size} is larger than the {len(train_feats)} training "
            "samples; lower it or add data"
        )

    state = tf.init(model, tx, mesh, seed=args.seed)
    heldout_before = _heldout_loss(state, heldout_feats, args.batch_size)

    losses: list[float] = []
    tokens = 0
    order = _sample_order(len(train_feats), args.steps * args.batch_size, args.seed)
    start = time.perf_counter()
    bar = tqdm(range(args.steps), desc="train", unit="step", disable=args.no_progress)
    for i in bar:
        batch_feats = [
            train_feats[j] for j in order[i * args.batch_size : (i + 1) * args.batch_size]
        ]
        tokens += sum(len(f["input_ids"]) for f in batch_feats)  # every data rank's
        grads = None
        local = batch_feats[mesh.get_slice(len(batch_feats), rank())]  # this data rank's
        for micro in split_features(local, args.micro_batches):
            grads, _ = tf.fwd_bwd(state, pack(micro), accum=grads)
        try:
            state, info = tf.step(state, grads, on_nonfinite="raise")
        except tf.NonFiniteError as e:
            raise ValueError(
                f"training diverged, stopping without saving (any checkpoint in {out} is left "
                f"as it was): {e}"
            ) from e
        losses.append(float(info["loss"]))
        bar.set_postfix(
            loss=f"{losses[-1]:.3f}", tok_s=f"{tokens / (time.perf_counter() - start):.0f}"
        )
    wall = time.perf_counter() - start

    heldout_after = _heldout_loss(state, heldout_feats, args.batch_size)
    ckpt = tf.checkpoint.save(state, out / "checkpoint", tokenizer=tokenizer)
    plot = out / "loss.png"
    if rank() == 0:
        plot_losses(losses, heldout_before, heldout_after, plot)
    summary = Summary(
        model=args.model or "tiny-qwen2 (random init)",
        data=args.data or "arithmetic (built-in)",
        steps=args.steps,
        train_samples=len(train_feats),
        heldout_samples=len(heldout_feats),
        train_tokens=tokens,
        wall_s=wall,
        tokens_per_s=tokens / wall,
        heldout_loss_before=heldout_before,
        heldout_loss_after=heldout_after,
        train_loss_first=losses[0],
        train_loss_last=sum(losses[-10:]) / len(losses[-10:]),
        checkpoint=str(ckpt),
        plot=str(plot),
    )
    if rank() == 0:
        (out / "summary.json").write_text(json.dumps(asdict(summary), indent=2))
    return summary


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


def _world_mesh(args: argparse.Namespace) -> tf.Mesh:
    """`--mesh`, by default data parallelism over the whole world (printed by rank 0 when it
    has several processes). Raises ``ValueError`` for a mesh that does not match the world,
    and for a batch that leaves a data rank fewer samples than micro-batches."""
    mesh = args.mesh or tf.Mesh(dp=world_size())
    mesh.validate(world_size())
    if args.mesh is None and world_size() > 1 and rank() == 0:
        print(f"twinkle train: no --mesh given; data parallel over the world: {_sizes(mesh)}")
    per_rank = args.batch_size // mesh.data_world_size
    if per_rank < args.micro_batches:
        raise ValueError(
            f"--batch-size {args.batch_size} over {mesh.data_world_size} data ranks "
            f"({_sizes(mesh)}) leaves {per_rank} samples per rank, fewer than --micro-batches "
            f"{args.micro_batches}; raise --batch-size to at least "
            f"{mesh.data_world_size * args.micro_batches} or lower --micro-batches"
        )
    return mesh


def _sizes(mesh: tf.Mesh) -> str:
    """``"dp=2,tp=2"``: the mesh's axes of size > 1 (``"one process"`` for none)."""
    axes = ("dp", "fsdp", "tp", "pp", "cp", "ep", "etp")
    return ",".join(f"{a}={getattr(mesh, a)}" for a in axes if getattr(mesh, a) > 1) or (
        "one process"
    )


def _optimizer(args: argparse.Namespace) -> tf.optim.GradientTransformation:
    """Clipping to norm 1, then AdamW with a warmup-cosine schedule from --lr down to a tenth.

    Raises ``ValueError`` (before anything is built) for an lr that is not a positive finite
    number, a negative or non-finite weight decay, and an explicit warmup that is not shorter
    than the run (it would never reach --lr): the same policy as the library's schedules and
    optimizers, which refuse them too.
    """
    if not math.isfinite(args.weight_decay) or args.weight_decay < 0:
        raise ValueError(
            f"--weight-decay must be a finite number >= 0, got {args.weight_decay}; pass e.g. "
            "--weight-decay 0.01"
        )
    schedule = tf.schedules.warmup_cosine(
        peak_lr=_check_lr(args.lr),
        warmup_steps=_warmup_steps(args),
        decay_steps=args.steps,
        min_lr=args.lr * 0.1,
    )
    return tf.optim.chain(
        tf.optim.clip_by_global_norm(1.0),
        tf.optim.adamw(schedule, weight_decay=args.weight_decay),
    )


def _check_lr(lr: float) -> float:
    """`lr`; raises ``ValueError`` unless it is a positive finite number."""
    if not math.isfinite(lr) or lr <= 0:
        raise ValueError(
            f"--lr must be a positive finite number, got {lr}: a learning rate of 0 trains "
            "nothing; pass e.g. --lr 3e-3"
        )
    return lr


def _warmup_steps(args: argparse.Namespace) -> int:
    """`--warmup-steps`, or by default 20 capped to ``steps - 1``. Raises ``ValueError`` for
    an explicit warmup that is not shorter than the run."""
    if args.warmup_steps is None:
        return min(DEFAULT_WARMUP_STEPS, args.steps - 1)
    if args.warmup_steps >= args.steps:
        raise ValueError(
            f"--warmup-steps {args.warmup_steps} must be < --steps {args.steps}: the warmup would "
            f"outlast the run and never reach --lr; lower --warmup-steps (e.g. "
            f"{args.steps // 10}) or raise --steps"
        )
    return args.warmup_steps


def _max_length(args: argparse.Namespace, max_positions: int) -> int:
    """`--max-length`, or by default `DEFAULT_MAX_LENGTH` capped to `max_positions` (the
    model's ``max_position_embeddings``). Raises ``ValueError`` for an explicit length past
    them: positions the model has no embedding for would train without a word."""
    if args.max_length is None:
        return min(DEFAULT_MAX_LENGTH, max_positions)
    if args.max_length > max_positions:
        raise ValueError(
            f"--max-length {args.max_length} exceeds the model's max_position_embeddings "
            f"({max_positions}); pass --max-length {max_positions} or less"
        )
    return args.max_length


def _model_and_tokenizer(args: argparse.Namespace) -> tuple[tf.models.Model, Any]:
    if args.model is None:
        tokenizer = char_tokenizer()
        config = tiny_qwen2_config(len(tokenizer))
        config.pad_token_id = tokenizer.pad_token_id
        config.eos_token_id = tokenizer.eos_token_id
        return tf.models.from_hf_config(config, precision=args.precision, seed=args.seed), tokenizer
    path = tf.models.resolve_model_dir(args.model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"--model {args.model}: no tokenizer could be loaded from {path} ({e}); "
            "save the tokenizer into the model directory"
        ) from e
    return tf.models.from_pretrained(path, precision=args.precision), tokenizer


def _heldout_loss(state: tf.TrainState, feats: list[dict[str, Any]], batch_size: int) -> float:
    """Token-mean loss over every held-out sample."""
    loss_sum, num_tokens = 0.0, 0
    for i in range(0, len(feats), batch_size):
        out = tf.evaluate(state, pack(feats[i : i + batch_size]))
        loss_sum += float(out.loss_sum)
        num_tokens += int(out.num_tokens)
    return loss_sum / max(num_tokens, 1)


def _sample_order(n: int, total: int, seed: int) -> list[int]:
    """Indices for `total` draws: shuffled epochs over `n` samples, deterministic in `seed`."""
    rng = random.Random(seed)
    order: list[int] = []
    while len(order) < total:
        epoch = list(range(n))
        rng.shuffle(epoch)
        order.extend(epoch)
    return order[:total]


def _mesh(text: str) -> tf.Mesh:
    """``"dp=2,tp=2"`` -> ``Mesh(dp=2, tp=2)``."""
    try:
        sizes = {k.strip(): int(v) for k, v in (part.split("=") for part in text.split(","))}
        return tf.Mesh(**sizes)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a mesh; write sizes like fsdp=2 or dp=2,tp=2 ({e})"
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
