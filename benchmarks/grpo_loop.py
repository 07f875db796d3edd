"""The whole GRPO loop (`twinkle_fn.grpo.iterations`, what ``cookbook/grpo.py`` and ``twinkle
rl`` run) on one device: tokens/s of the training step and GB/s of the weight stream.

A randomly initialised Qwen2.5-shaped model (`benchmarks.shapes.QWEN25_SHAPES`, no download) is
the trainer, on the transformers backend (``--backend megatron`` for megatron-core's), bf16
compute over fp32 master weights on a GPU; a plain HF model of the same shape is the sampler,
fed by ``tf.export_weights`` after every step (bf16 on a GPU). Prompts are the built-in
arithmetic task's (a character tokenizer: ids past its ~100 symbols decode to nothing, so a
random model's reward stays near 0; the reward is reported, not the point). Per iteration the
loop records (medians over the iterations after ``--warmup``):

- ``train_tokens_per_s``: the batch's tokens (prompt + completion, padded) times the PPO epochs
  over their ``tf.fwd_bwd`` + ``tf.step`` seconds, and its MFU (`benchmarks.flops`'s formula
  at the batch's padded length);
- ``sync_gb_per_s``: bytes of the exported weights over the seconds of streaming them into the
  sampler (``load_state_dict`` bucket by bucket);
- ``rollout_s`` (sampling, a plain loop of full forwards without a KV cache: not an inference
  engine's speed) and ``train_s`` (old log-probs, reference log-probs, PPO epochs).

    python -m benchmarks.grpo_loop --device cuda --shape qwen2.5-0.5b --json grpo_loop.json
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch
from transformers import AutoModelForCausalLM

import twinkle_fn as tf
from benchmarks.cli import device_of, positive_int
from benchmarks.flops import MFU_FORMULA, default_peak, flops_per_token, mfu
from benchmarks.report import device_name, fmt, versions, write_json
from benchmarks.shapes import QWEN25_SHAPES, qwen25_config
from benchmarks.timing import peak_gib
from benchmarks.training import backend_world, twinkle_optimizer
from twinkle_fn import grpo
from twinkle_fn.data import char_tokenizer

TIMED = ("train_tokens_per_s", "sync_gb_per_s", "rollout_s", "train_s", "sync_s", "tokens")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the loop, print a summary and return (and write to ``--json``) the results."""
    args = _parser().parse_args(argv)
    device = device_of(args.device)
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    config = qwen25_config(args.shape)
    tokenizer = char_tokenizer()
    rl = grpo.GRPOConfig(
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        max_new_tokens=args.max_new_tokens,
        ppo_epochs=args.ppo_epochs,
        beta=args.beta,
    )
    steps = args.warmup + args.steps
    with backend_world(args.backend, device):
        # the megatron backend builds its own model on the device; its HF module stays on the host
        home = device if args.backend == "transformers" else torch.device("cpu")
        with torch.device(home):
            model = tf.models.from_hf_config(
                config, backend=args.backend, precision=precision, device=home, seed=0
            )
        state = tf.init(model, twinkle_optimizer(args.backend))
        with device:
            sampler = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        grpo.sync(sampler, state, dtype)
        reference = grpo.reference_of(sampler) if rl.beta > 0 else None
        prompts = grpo.task_prompts(tokenizer, steps * rl.prompts_per_step, seed=0)
        records = [
            record
            for _, record in grpo.iterations(
                state, sampler, tokenizer, prompts, rl, steps, reference=reference, sync_dtype=dtype
            )
        ]
    timed = records[args.warmup :]
    medians = {k: statistics.median(r[k] for r in timed) for k in TIMED}
    seq = medians["tokens"] / (rl.prompts_per_step * rl.group_size)  # padded length
    flops = flops_per_token(config, round(seq))
    peak = args.peak_flops or default_peak(device)
    result = {
        "shape": args.shape,
        "backend": args.backend,
        "precision": precision,
        "device_name": device_name(device),
        "grpo": vars(args) | {"device": str(device)},
        "samples_per_step": rl.prompts_per_step * rl.group_size,
        "padded_seq": seq,
        **medians,
        "train_mfu": mfu(medians["train_tokens_per_s"], flops, peak),
        "mfu_formula": MFU_FORMULA,
        "peak_mem_gib": peak_gib(device),
        "reward_first": records[0]["reward"],
        "reward_last": records[-1]["reward"],
        "records": records,
        "versions": versions(),
    }
    write_json(result, args.json)
    _print(result)
    return result


def _print(result: dict[str, Any]) -> None:
    print(
        f"GRPO loop, {result['shape']} on the {result['backend']} backend, {result['precision']}, "
        f"on {result['device_name']}; {result['samples_per_step']} samples x "
        f"{result['padded_seq']:.0f} tokens per step"
    )
    print(
        f"train step: {result['train_tokens_per_s']:.0f} tokens/s "
        f"(MFU {fmt(result['train_mfu'], '.1f', 100.0, '%')}); weight stream: "
        f"{result['sync_gb_per_s']:.2f} GB/s ({result['sync_s'] * 1e3:.1f} ms); rollouts "
        f"{result['rollout_s']:.2f} s, train {result['train_s']:.2f} s per step; peak "
        f"{fmt(result['peak_mem_gib'], '.1f')} GiB; reward {result['reward_first']:.3f} -> "
        f"{result['reward_last']:.3f}"
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=tuple(QWEN25_SHAPES), default="qwen2.5-0.5b")
    p.add_argument("--backend", choices=("transformers", "megatron"), default="transformers")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--precision", choices=("fp32", "bf16"), help="default: bf16 on cuda")
    p.add_argument("--steps", type=positive_int, default=5, help="timed iterations")
    p.add_argument("--warmup", type=positive_int, default=2, help="untimed iterations first")
    p.add_argument("--prompts-per-step", type=positive_int, default=16)
    p.add_argument("--group-size", type=positive_int, default=8)
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--ppo-epochs", type=positive_int, default=2)
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--peak-flops", type=float, default=None, help="default: 989e12 on H100/H200")
    p.add_argument("--json", default=None)
    return p


if __name__ == "__main__":
    main()
