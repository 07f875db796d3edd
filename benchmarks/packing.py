"""Training throughput on packed rows: twinkle_fn's varlen attention beside a plain loop.

Samples of varied lengths packed back to back into one row (`twinkle_fn.data.pack`, what
``twinkle train`` feeds), the same Qwen2.5-shaped random-init model, bf16 autocast over fp32
master weights, AdamW and clipping as in `benchmarks.throughput`:

- ``hf_loop``: a plain transformers loop on SDPA given the packed ``position_ids`` and no mask:
  transformers finds the samples from the positions and builds a ``[T, T]`` block mask (the
  plain loop's way without flash-attn);
- ``hf_compiled``: the same with ``torch.compile`` of the whole model (GPU only);
- ``twinkle_fsdp`` / ``twinkle_fsdp_compiled``: ``tf.fwd_bwd`` + ``tf.step`` on the
  transformers backend (each decoder layer compiled in the second; GPU only), whose packed rows
  take a varlen kernel on CUDA (`twinkle_fn.varlen_attention`);
- ``twinkle_megatron`` / ``twinkle_megatron_compiled``: the same on the megatron backend (THD).

Each row warms up, then takes the median of timed steps with the device synchronised around
each. It prints tokens/s, MFU (formula printed: attention counted per sample), peak memory and
the ratio to each baseline, and writes JSON.

    python -m benchmarks.packing --shape qwen2.5-0.5b --tokens 16384 --max-len 4096
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from benchmarks import throughput as tp
from twinkle_fn import backends
from twinkle_fn.data import pack

ROWS = (
    "hf_loop",
    "hf_compiled",
    "twinkle_fsdp",
    "twinkle_fsdp_compiled",
    "twinkle_megatron",
    "twinkle_megatron_compiled",
)
BASELINES = ("hf_loop", "hf_compiled")
Builder = Callable[[tp.Setup, dict[str, Any]], contextlib.AbstractContextManager[tp.Step]]
MFU_FORMULA = (
    "MFU = tokens/s x (6 x matmul params incl. lm_head + 6 x layers x hidden x "
    "sum(len_i^2) / tokens) / peak"
)


def sample_lengths(tokens: int, max_len: int, seed: int = 0) -> list[int]:
    """Sample lengths drawn uniformly from ``[max_len // 8, max_len]`` (at least 1) until they
    fill `tokens` exactly (the last one cut short). Raises ``ValueError`` unless both are > 0."""
    if tokens < 1 or max_len < 1:
        raise ValueError(f"tokens and max_len must be positive, got {tokens} and {max_len}")
    rng = random.Random(seed)
    lengths: list[int] = []
    while (left := tokens - sum(lengths)) > 0:
        lengths.append(min(left, rng.randint(max(1, max_len // 8), max_len)))
    return lengths


def packed_batch(lengths: list[int], vocab_size: int, seed: int = 0) -> dict[str, Any]:
    """One packed row of random-token samples of `lengths`, each trained on its next tokens."""
    gen = torch.Generator().manual_seed(seed)
    feats = []
    for n in lengths:
        ids = torch.randint(0, vocab_size, (n,), generator=gen).tolist()
        feats.append({"input_ids": ids, "labels": [*ids[1:], -100]})
    return pack(feats)


def flops_per_token(config: PretrainedConfig, lengths: list[int]) -> float:
    """`MFU_FORMULA`'s FLOPs per token: with equal lengths S, throughput's ``6 N + 6 L H S``."""
    attention = sum(n * n for n in lengths) / sum(lengths)
    layers, hidden = config.num_hidden_layers, config.hidden_size
    return 6 * tp.matmul_params(config) + 6 * layers * hidden * attention


def main(argv: list[str] | None = None) -> dict:
    """Run the selected rows and return (and print, and write) the results."""
    args = _parser().parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = tp.qwen25_config(args.shape)
    lengths = sample_lengths(args.tokens, args.max_len)
    batch = packed_batch(lengths, config.vocab_size)
    setup = tp.Setup(config, batch["input_ids"].to(device), device, "model")
    fpt = flops_per_token(config, lengths)
    peak = tp.default_peak(device)
    result: dict[str, Any] = {
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "versions": tp.versions(),
        "shape": args.shape,
        "lengths": lengths,
        "tokens_per_step": args.tokens,
        "flops_per_token": fpt,
        "peak_flops": peak,
        "mfu_formula": MFU_FORMULA,
        "rows": {},
    }
    print(
        f"{args.shape}, one packed row of {len(lengths)} samples ({args.tokens} tokens, longest "
        f"{max(lengths)}) on {result['device_name']}; {MFU_FORMULA}, {fpt / 1e9:.3f} GFLOP/token"
    )
    for name in args.rows:
        row = _run_row(name, setup, batch, args.warmup, args.steps)
        if row["status"] == "ok":
            row["mfu"] = tp.mfu(row["tokens_per_s"], fpt, peak)
        result["rows"][name] = row
        tp.add_ratios(result["rows"], BASELINES)
        print(f"{name}: {_line(row)}", flush=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


def _run_row(
    name: str, setup: tp.Setup, batch: dict[str, Any], warmup: int, steps: int
) -> dict[str, Any]:
    """One row's measurement, or why it was skipped or failed."""
    if "_compiled" in name and setup.device.type != "cuda":
        return {"status": "skipped", "reason": "GPU only (compiling on a CPU takes minutes)"}
    if "megatron" in name and "megatron" not in backends.names():
        return {"status": "skipped", "reason": "no megatron backend in twinkle_fn.backends"}
    tp.release(setup.device)
    try:
        with _ROW_BUILDERS[name](setup, batch) as step:
            timing = tp.time_steps(step, warmup, steps, setup.device)
            peak_gib = tp._peak_gib(setup.device)
    except Exception as e:  # a failing row is a result (out of memory), not a crash
        return {"status": "error", "error": f"{type(e).__name__}: {e}"[:500]}
    finally:
        tp.release(setup.device)
    tokens = setup.input_ids.numel()
    return {
        "status": "ok",
        "step_ms": 1e3 * timing.seconds,
        "tokens_per_s": tokens / timing.seconds,
        "peak_mem_gib": peak_gib,
        "first_loss": timing.first_loss,
        "last_loss": timing.last_loss,
    }


def _hf_step(setup: tp.Setup, batch: dict[str, Any], compiled: bool) -> tp.Step:
    """The plain loop on the packed row: positions passed, mask left to transformers."""
    device = setup.device
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            setup.config, dtype=torch.float32, attn_implementation="sdpa"
        ).train()
    params = list(model.parameters())
    fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(params, lr=tp._LR, weight_decay=tp._WEIGHT_DECAY, **fused)
    forward = torch.compile(model, dynamic=False) if compiled else model
    ids, positions, labels = (batch[k].to(device) for k in ("input_ids", "position_ids", "labels"))

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            # the labels are shifted per sample already: shift_labels keeps HF from shifting
            out = forward(input_ids=ids, position_ids=positions, labels=labels, shift_labels=labels)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, tp._CLIP, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss.detach()

    return step


def _twinkle(backend: str, compiled: bool) -> Builder:
    @contextlib.contextmanager
    def build(setup: tp.Setup, batch: dict[str, Any]) -> Iterator[tp.Step]:
        options = {"compile_layers": True} if compiled else None
        world = tp.megatron_world(setup.device) if backend == "megatron" else _nothing()
        with world:
            yield tp._twinkle_step(setup, backend, options, batch=_host(batch, setup.device))

    return build


def _hf(compiled: bool) -> Builder:
    @contextlib.contextmanager
    def build(setup: tp.Setup, batch: dict[str, Any]) -> Iterator[tp.Step]:
        yield _hf_step(setup, batch, compiled)

    return build


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


def _host(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """`batch` in pinned host memory on a GPU (its ``max_seqlen`` stays an int)."""
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    return {**batch, **tp.host_batch(tensors, device)}


_ROW_BUILDERS: dict[str, Builder] = {
    "hf_loop": _hf(compiled=False),
    "hf_compiled": _hf(compiled=True),
    "twinkle_fsdp": _twinkle("fsdp", compiled=False),
    "twinkle_fsdp_compiled": _twinkle("fsdp", compiled=True),
    "twinkle_megatron": _twinkle("megatron", compiled=False),
    "twinkle_megatron_compiled": _twinkle("megatron", compiled=True),
}


def _line(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return f"{row['status']}: {row.get('error') or row.get('reason')}"
    cells = [
        f"{row['tokens_per_s']:.0f} tokens/s",
        f"{row['step_ms']:.1f} ms/step",
        "MFU n/a" if row["mfu"] is None else f"MFU {100 * row['mfu']:.1f}%",
        "peak n/a" if row["peak_mem_gib"] is None else f"peak {row['peak_mem_gib']:.1f} GiB",
        *(
            f"x {base} {'n/a' if row[f'x_{base}'] is None else format(row[f'x_{base}'], '.2f')}"
            for base in BASELINES
        ),
        f"loss {row['first_loss']:.3f} -> {row['last_loss']:.3f}",
    ]
    return ", ".join(cells)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=tuple(tp.SHAPES), default="qwen2.5-0.5b")
    p.add_argument("--tokens", type=tp._positive_int, default=16384)
    p.add_argument("--max-len", type=tp._positive_int, default=4096)
    p.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    p.add_argument("--steps", type=tp._positive_int, default=6)
    p.add_argument("--warmup", type=tp._positive_int, default=3)
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--json", default="packing.json")
    return p


if __name__ == "__main__":
    main()
