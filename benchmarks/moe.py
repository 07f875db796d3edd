"""MoE training throughput on one device: issue 24's Qwen3-30B-A3B shape cut to a few layers.

Every row trains the same randomly initialised Qwen3-MoE model (config built by hand, no
download) on the same ``[batch, seq]`` random tokens, bf16 compute, AdamW (lr 1e-5, weight decay
0.01) with global-norm clipping at 1.0, as `benchmarks.throughput` does:

- ``hf_loop``: a plain transformers loop (its default experts implementation), bf16 autocast
  over fp32 parameters; ``hf_compiled``: the same ``torch.compile``'d (GPU only);
- ``twinkle_fsdp``: ``tf.fwd_bwd`` + ``tf.step`` on the transformers backend;
- ``twinkle_megatron_sequential``: the megatron backend with megatron-core's ``SequentialMLP``
  experts (a Python loop over experts; option ``grouped_experts=False``);
- ``twinkle_megatron_grouped``: the megatron backend with its default experts, two grouped
  GEMMs per layer (`twinkle_fn.backends.megatron.grouped_experts`);
- ``*_compiled``: the twinkle rows with option ``compile_layers`` (GPU only; on megatron the
  MoE dispatch stays eager, `twinkle_fn.backends.megatron.layer_compile`);
- ``*_lora`` rows: the same with a LoRA adapter (`LORA`: rank 16, ``"all-linear"``, which on an
  MoE model adapts attention and every routed expert, see `twinkle_fn.lora`), only the adapter
  training; ``hf_loop_lora`` is peft on the plain loop (``get_peft_model`` with the same targets,
  the experts through ``target_parameters``).

Each row warms up, then takes the median of timed steps. It prints tokens/s, MFU (formula
printed: active parameters, i.e. the top-k experts a token visits), CUDA peak memory (over the
whole row, and of one more step alone) and the ratio to each baseline, and writes JSON after every row.

    python -m benchmarks.moe --shape qwen3-30b-a3b --layers 2 --seq 2048 --batch 4
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

from benchmarks.cli import device_of, positive_int
from benchmarks.flops import default_peak, mfu
from benchmarks.report import add_ratios, device_name, fmt, summary, versions
from benchmarks.timing import Step, peak_gib, run_isolated, skipped_row, time_steps
from benchmarks.training import Setup, backend_world, hf_loop_step, hf_model, hf_step, twinkle_step

_QWEN3_MOE = dict(
    model_type="qwen3_moe",
    max_position_embeddings=40960,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    output_router_logits=False,
)
SHAPES = MappingProxyType(
    {
        "tiny": dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
        ),
        "qwen3-30b-a3b": dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
        ),
    }
)
ROWS = (
    "hf_loop",
    "hf_compiled",
    "twinkle_fsdp",
    "twinkle_fsdp_compiled",
    "twinkle_megatron_sequential",
    "twinkle_megatron_grouped",
    "twinkle_megatron_grouped_compiled",
    "hf_loop_lora",
    "twinkle_fsdp_lora",
    "twinkle_megatron_grouped_lora",
)
BASELINES = ("hf_loop", "hf_compiled", "hf_loop_lora")
LORA = MappingProxyType({"r": 16, "lora_alpha": 32, "target_modules": "all-linear"})
MFU_FORMULA = (
    "MFU = tokens/s x (6 x active matmul params per token (attention, router, top-k experts, "
    "lm_head) + 6 x layers x heads x head_dim x seq) / peak"
)


def moe_config(shape: str, layers: int) -> PretrainedConfig:
    """The HF ``Qwen3MoeConfig`` of `shape` (a key of `SHAPES`) with `layers` decoder layers.

    Raises ``ValueError`` for an unknown shape or fewer than one layer.
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; use one of {', '.join(SHAPES)}")
    if layers < 1:
        raise ValueError(f"layers must be positive, got {layers}")
    return AutoConfig.for_model(**{**_QWEN3_MOE, **SHAPES[shape], "num_hidden_layers": layers})


def active_matmul_params(config: PretrainedConfig) -> int:
    """Weights one token multiplies by: attention linears, the router, its top-k experts'
    three linears in every layer, and the lm_head (norms and embeddings do no matmul)."""
    hidden, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    q, k = heads * config.head_dim, kv * config.head_dim
    attention = 2 * hidden * q + 2 * hidden * k
    router = hidden * config.num_experts
    experts = config.num_experts_per_tok * 3 * hidden * config.moe_intermediate_size
    return config.num_hidden_layers * (attention + router + experts) + config.vocab_size * hidden


def flops_per_token(config: PretrainedConfig, seq: int) -> int:
    """Training FLOPs per token of `MFU_FORMULA`."""
    attention = config.num_hidden_layers * config.num_attention_heads * config.head_dim * seq
    return 6 * active_matmul_params(config) + 6 * attention


def main(argv: list[str] | None = None) -> dict:
    """Run the selected rows and return (and print, and write) the results."""
    args = _parser().parse_args(argv)
    device = device_of(args.device)
    config = moe_config(args.shape, args.layers)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=gen)
    setup = Setup(config, ids.to(device), device, "model")
    fpt, peak = flops_per_token(config, args.seq), default_peak(device)
    result: dict[str, Any] = {
        "device_name": device_name(device),
        "versions": versions(),
        "shape": args.shape,
        "layers": args.layers,
        "seq": args.seq,
        "batch": args.batch,
        "tokens_per_step": args.batch * args.seq,
        "active_matmul_params": active_matmul_params(config),
        "flops_per_token": fpt,
        "peak_flops": peak,
        "mfu_formula": MFU_FORMULA,
        "rows": {},
    }
    print(
        f"{args.shape}, {args.layers} layers, seq {args.seq}, batch {args.batch} on "
        f"{result['device_name']}; {MFU_FORMULA}; {fpt / 1e9:.3f} GFLOP/token, peak "
        f"{'n/a' if peak is None else f'{peak:.4g} FLOP/s'}"
    )
    for name in args.rows:
        row = _run_row(name, setup, args.warmup, args.steps)
        if row["status"] == "ok":
            row["mfu"] = mfu(row["tokens_per_s"], fpt, peak)
        result["rows"][name] = row
        add_ratios(result["rows"], BASELINES)
        print(f"{name}: {_line(row)}", flush=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


def _run_row(name: str, setup: Setup, warmup: int, steps: int) -> dict[str, Any]:
    """One row's measurement, or why it was skipped or failed."""
    return skipped_row(name, setup.device) or run_isolated(
        setup.device, lambda: _measure(name, setup, warmup, steps)
    )


def _measure(name: str, setup: Setup, warmup: int, steps: int) -> dict[str, Any]:
    with _ROW_BUILDERS[name](setup) as step:
        timing = time_steps(step, warmup, steps, setup.device)
        peak = peak_gib(setup.device)
        step_peak_gib = _step_peak_gib(step, setup.device)
    return {
        "status": "ok",
        "step_ms": 1e3 * timing.seconds,
        "tokens_per_s": setup.input_ids.numel() / timing.seconds,
        "peak_mem_gib": peak,
        "step_peak_gib": step_peak_gib,
        "first_loss": timing.first_loss,
        "last_loss": timing.last_loss,
    }


def _step_peak_gib(step: Step, device: torch.device) -> float | None:
    """The CUDA peak of one more step alone: warm-up and compilation excluded (``peak_mem_gib``
    includes them)."""
    if device.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return peak_gib(device)


def _hf(compiled: bool) -> Callable[[Setup], contextlib.AbstractContextManager[Step]]:
    @contextlib.contextmanager
    def build(setup: Setup) -> Iterator[Step]:
        yield hf_step(setup, compile_scope="model" if compiled else None)

    return build


def _twinkle(
    backend: str, options: dict[str, Any] | None = None, lora: bool = False
) -> Callable[[Setup], contextlib.AbstractContextManager[Step]]:
    @contextlib.contextmanager
    def build(setup: Setup) -> Iterator[Step]:
        with backend_world(backend, setup.device):
            yield twinkle_step(setup, backend, options, lora=dict(LORA) if lora else None)

    return build


@contextlib.contextmanager
def _hf_lora(setup: Setup) -> Iterator[Step]:
    """peft on the plain loop: `LORA`'s targets resolved as twinkle resolves them (attention
    linears, the fused experts through ``target_parameters``), only the adapter training."""
    from peft import get_peft_model

    from twinkle_fn.lora import lora_config, resolve_moe_targets

    model = hf_model(setup)
    model = get_peft_model(model, resolve_moe_targets(lora_config(dict(LORA)), model))
    params = [p for p in model.parameters() if p.requires_grad]
    yield hf_loop_step(model, params, setup)


_ROW_BUILDERS = MappingProxyType(
    {
        "hf_loop": _hf(compiled=False),
        "hf_compiled": _hf(compiled=True),
        "twinkle_fsdp": _twinkle("transformers"),
        "twinkle_fsdp_compiled": _twinkle("transformers", {"compile_layers": True}),
        "twinkle_megatron_sequential": _twinkle("megatron", {"grouped_experts": False}),
        "twinkle_megatron_grouped": _twinkle("megatron"),
        "twinkle_megatron_grouped_compiled": _twinkle("megatron", {"compile_layers": True}),
        "hf_loop_lora": _hf_lora,
        "twinkle_fsdp_lora": _twinkle("transformers", lora=True),
        "twinkle_megatron_grouped_lora": _twinkle("megatron", lora=True),
    }
)


def _line(row: dict[str, Any]) -> str:
    step_peak = f"step peak {fmt(row.get('step_peak_gib'), '.1f', unit=' GiB')}"
    return summary(row, BASELINES, extra=[step_peak])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=tuple(SHAPES), default="qwen3-30b-a3b")
    p.add_argument("--layers", type=positive_int, default=2)
    p.add_argument("--seq", type=positive_int, default=2048)
    p.add_argument("--batch", type=positive_int, default=4)
    p.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    p.add_argument("--steps", type=positive_int, default=10)
    p.add_argument("--warmup", type=positive_int, default=3)
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--json", default="moe.json")
    return p


if __name__ == "__main__":
    main()
