"""Upstream Twinkle's `TransformersModel` usage example, on a tiny local model.

The example from Twinkle's docs, unchanged but for the model id and the arguments its ``...``
left open (a LoRA adapter, AdamW, arithmetic chats encoded by the tokenizer's template). Its
mesh, dp 2 x fsdp 2, needs 4 processes; on CPU they join over gloo::

    python cookbook/make_tiny_model.py /tmp/tiny-qwen3
    torchrun --nproc_per_node 4 cookbook/transformers_fsdp2.py --model /tmp/tiny-qwen3
    python cookbook/transformers_fsdp2.py --model /tmp/tiny-qwen3 --dp-size 1 --fsdp-size 1
"""

from __future__ import annotations

import argparse

from peft import LoraConfig

from twinkle import DeviceMesh
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.device_mesh import current_rank
from twinkle.model import TransformersModel
from twinkle_fn.data import arithmetic_dataset


def run(
    model_id: str,
    dp_size: int = 2,
    fsdp_size: int = 2,
    num_samples: int = 512,
    batch_size: int = 8,
    gradient_accumulation_steps: int = 16,
    lr: float = 1e-3,
    mixed_precision: str = "bf16",
    return_model: bool = False,
) -> list[float] | tuple[list[float], TransformersModel]:
    """Train as the example does; returns the loss of every optimizer step, and with
    `return_model` the trained model too (to save or evaluate it). `mixed_precision`: the
    model's (the example leaves upstream's default, bf16; ``'no'`` for float32)."""
    device_mesh = DeviceMesh.from_sizes(dp_size=dp_size, fsdp_size=fsdp_size)
    dataset = Dataset(DatasetMeta(data=arithmetic_dataset(num_samples)))
    dataset.set_template("Template", model_id=model_id, max_length=128)
    dataset.encode()
    dataloader = DataLoader(dataset, batch_size=batch_size, device_mesh=device_mesh)

    # The docs' example: only model_id changed, mixed_precision a flag (default upstream's bf16),
    # and the `...` filled in.
    model = TransformersModel(
        model_id=model_id,
        device_mesh=device_mesh,
        mixed_precision=mixed_precision,
        remote_group="actor",
    )
    model.add_adapter_to_model(
        "default", LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    )
    model.set_optimizer("AdamW", lr=lr, adapter_name="default")
    losses = []
    for data in dataloader:
        model.forward_backward(inputs=data, adapter_name="default")
        grad_norm = model.clip_grad_and_step(
            max_grad_norm=1.0,
            gradient_accumulation_steps=gradient_accumulation_steps,
            adapter_name="default",
        )
        if grad_norm is not None:
            losses.append(model.calculate_metric(is_training=True)["loss"])
    return (losses, model) if return_model else losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="local model dir (make_tiny_model.py)")
    parser.add_argument("--dp-size", type=int, default=2)
    parser.add_argument("--fsdp-size", type=int, default=2)
    parser.add_argument("--num-samples", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=16)
    args = parser.parse_args()
    losses = run(
        args.model,
        args.dp_size,
        args.fsdp_size,
        args.num_samples,
        args.batch_size,
        args.gradient_accumulation_steps,
    )
    if current_rank() == 0:
        for i, loss in enumerate(losses, start=1):
            print(f"step {i}: loss {loss:.4f}")


if __name__ == "__main__":
    main()
