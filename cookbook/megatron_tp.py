"""Upstream Twinkle's `MegatronModel` usage example, on a tiny local model.

The example from Twinkle's docs, unchanged but for the model id and the arguments its ``...``
left open (a LoRA adapter on every linear, arithmetic chats encoded by the tokenizer's
template, megatron's distributed Adam). One departure, forced by CPUs: ``mixed_precision='no'``
(fp32). The docs' mesh is dp 2 x tp 2 x pp 2 (8 processes); the sizes are flags, here tp 2
over 2 gloo processes::

    python cookbook/make_tiny_model.py /tmp/tiny-qwen3
    torchrun --nproc_per_node 2 cookbook/megatron_tp.py --model /tmp/tiny-qwen3 --tp-size 2
    python cookbook/megatron_tp.py --model /tmp/tiny-qwen3
"""

from __future__ import annotations

import argparse

from peft import LoraConfig

from twinkle import DeviceMesh
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.device_mesh import current_rank
from twinkle.model import MegatronModel
from twinkle_fn.data import arithmetic_dataset


def run(
    model_id: str,
    dp_size: int = 1,
    tp_size: int = 1,
    pp_size: int = 1,
    num_samples: int = 256,
    batch_size: int = 8,
    gradient_accumulation_steps: int = 16,
    lr: float = 1e-3,
    return_model: bool = False,
) -> list[float] | tuple[list[float], MegatronModel]:
    """Train a LoRA adapter as the example does; returns the loss of every optimizer step, and
    with `return_model` the trained model too (to save or evaluate it)."""
    device_mesh = DeviceMesh.from_sizes(dp_size=dp_size, tp_size=tp_size, pp_size=pp_size)
    dataset = Dataset(DatasetMeta(data=arithmetic_dataset(num_samples)))
    dataset.set_template("Template", model_id=model_id, max_length=128)
    dataset.encode()
    dataloader = DataLoader(dataset, batch_size=batch_size, device_mesh=device_mesh)

    # The docs' example: model_id and mixed_precision changed, the `...` filled in.
    model = MegatronModel(
        model_id=model_id, device_mesh=device_mesh, mixed_precision="no", remote_group="actor"
    )
    model.add_adapter_to_model(
        "default",
        LoraConfig(r=8, lora_alpha=32, target_modules="all-linear"),
        gradient_accumulation_steps=gradient_accumulation_steps,
    )
    model.set_optimizer("default", adapter_name="default", lr=lr, clip_grad=1.0)
    losses = []
    for data in dataloader:
        model.forward_backward(inputs=data)
        grad_norm = model.clip_grad_and_step(
            max_grad_norm=1.0, gradient_accumulation_steps=gradient_accumulation_steps
        )
        if grad_norm is not None:
            losses.append(model.calculate_metric(is_training=True)["loss"])
    return (losses, model) if return_model else losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="local model dir (make_tiny_model.py)")
    parser.add_argument("--dp-size", type=int, default=1)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--pp-size", type=int, default=1)
    parser.add_argument("--num-samples", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=16)
    args = parser.parse_args()
    losses = run(
        args.model,
        args.dp_size,
        args.tp_size,
        args.pp_size,
        args.num_samples,
        args.batch_size,
        args.gradient_accumulation_steps,
    )
    if current_rank() == 0:
        for i, loss in enumerate(losses, start=1):
            print(f"step {i}: loss {loss:.4f}")


if __name__ == "__main__":
    main()
