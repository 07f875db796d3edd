"""What a `twinkle train` / `twinkle rl` run is built from: the mesh over the world, the model
(with its LoRA adapter) and tokenizer, the sample length, the checkpoint to start from and what
the megatron block offloads. Each raises ``ValueError`` naming the setting before any compute."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, Qwen2Config

import twinkle_fn as tf
from twinkle.cli import config as cfg
from twinkle.cli._flags import _mesh
from twinkle_fn.data import char_tokenizer
from twinkle_fn.distributed import rank, world_size

DEFAULT_MAX_LENGTH = 256


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
    if config.fp8_store_frozen:
        options["fp8_store_frozen"] = True
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
