"""Supervised fine-tuning with a LoRA adapter through the class API, on CPU.

Arithmetic chats (the `twinkle train` demo data) encoded by the model's chat template with
assistant-only labels, packed padding-free, a cosine schedule with warmup, gradient
accumulation, held-out loss before and after, and a resumable checkpoint::

    python cookbook/make_tiny_model.py /tmp/tiny-qwen3
    python cookbook/sft_lora.py --model /tmp/tiny-qwen3 --output-dir /tmp/sft-lora
    torchrun --nproc_per_node 2 cookbook/sft_lora.py --model /tmp/tiny-qwen3 --fsdp-size 2
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

from peft import LoraConfig

import twinkle
from twinkle import DeviceMesh
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.device_mesh import current_rank
from twinkle.model import TransformersModel
from twinkle.template import Template
from twinkle_fn.data import arithmetic_dataset, train_heldout_split


def heldout_loss(model: TransformersModel, dataset: Dataset, batch_size: int) -> float:
    """Token-mean loss of `model` over every row of `dataset` (this rank's view)."""
    for start in range(0, len(dataset), batch_size):
        model.forward_only(inputs=dataset[start : start + batch_size], adapter_name="sft")
    return model.calculate_metric(is_training=False, adapter_name="sft")["loss"]


def run(
    model_id: str,
    output_dir: str,
    fsdp_size: int = 1,
    steps: int = 30,
    batch_size: int = 16,
    gradient_accumulation_steps: int = 2,
    lr: float = 3e-3,
    num_samples: int = 1024,
) -> dict[str, Any]:
    """Train `steps` optimizer steps; returns losses, held-out losses and the checkpoint."""
    device_mesh = DeviceMesh.from_sizes(fsdp_size=fsdp_size)
    twinkle.initialize(mode="local", seed=42, global_device_mesh=device_mesh)
    train_rows, heldout_rows = train_heldout_split(arithmetic_dataset(num_samples))
    template = Template(model_id, max_length=128, truncation_strategy="delete")
    train, heldout = Dataset(DatasetMeta(data=train_rows)), Dataset(DatasetMeta(data=heldout_rows))
    for dataset in (train, heldout):
        dataset.set_template(template)
        dataset.encode()
    micro_batch = batch_size // gradient_accumulation_steps
    dataloader = DataLoader(train, batch_size=micro_batch, shuffle=True)

    model = TransformersModel(model_id=model_id, mixed_precision="bf16")
    model.add_adapter_to_model(
        "sft",
        LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"),
        gradient_accumulation_steps=gradient_accumulation_steps,
    )
    model.set_template(template, adapter_name="sft")
    model.set_processor("InputProcessor", padding_free=True, adapter_name="sft")
    model.set_optimizer("AdamW", lr=lr, weight_decay=0.01, adapter_name="sft")
    model.set_lr_scheduler(
        "CosineWarmupScheduler",
        num_warmup_steps=max(steps // 10, 1),
        num_training_steps=steps,
        adapter_name="sft",
    )
    before = heldout_loss(model, heldout, batch_size)
    losses: list[float] = []
    epochs = itertools.count()
    while len(losses) < steps:
        next(epochs)
        for batch in dataloader:
            model.forward_backward(inputs=batch, adapter_name="sft")
            if model.clip_grad_and_step(max_grad_norm=1.0, adapter_name="sft") is not None:
                losses.append(model.calculate_metric(is_training=True, adapter_name="sft")["loss"])
            if len(losses) == steps:
                break
    after = heldout_loss(model, heldout, batch_size)
    checkpoint = model.save(
        "final",
        output_dir=output_dir,
        save_optimizer=True,
        consumed_train_samples=dataloader.get_state()["consumed_train_samples"],
        adapter_name="sft",
    )
    return {
        "losses": losses,
        "heldout_before": before,
        "heldout_after": after,
        "checkpoint": checkpoint,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="local model dir (make_tiny_model.py)")
    parser.add_argument("--output-dir", default="output/sft-lora")
    parser.add_argument("--fsdp-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    result = run(args.model, args.output_dir, args.fsdp_size, args.steps)
    if current_rank() == 0:
        print(f"train loss: {result['losses'][0]:.3f} -> {result['losses'][-1]:.3f}")
        print(f"held-out loss: {result['heldout_before']:.3f} -> {result['heldout_after']:.3f}")
        print(f"adapter saved to {result['checkpoint']}")


if __name__ == "__main__":
    main()
