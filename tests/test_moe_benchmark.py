"""`benchmarks.moe` keeps running on CPU at a tiny shape (GPU-only rows skipped); timings are
never asserted."""

import json
import math

import pytest
from transformers import AutoModelForCausalLM

from benchmarks import moe
from twinkle_fn import backends

_TINY = ["--shape", "tiny", "--seq", "16", "--batch", "2", "--steps", "2", "--warmup", "1"]
_MEGATRON = ("twinkle_megatron_sequential", "twinkle_megatron_grouped")
_LORA = ("hf_loop_lora", "twinkle_fsdp_lora", "twinkle_megatron_grouped_lora")


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe") / "r.json"
    return moe.main([*_TINY, "--device", "cpu", "--json", str(out)]), out


def test_cpu_run_reports_every_row_and_writes_the_same_json(cpu_run):
    result, out = cpu_run
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert set(result["rows"]) == set(moe.ROWS)
    assert result["rows"]["hf_compiled"]["status"] == "skipped"


@pytest.mark.parametrize("name", ["hf_loop", "twinkle_fsdp", *_MEGATRON, *_LORA])
def test_cpu_rows_train(cpu_run, name):
    """Random init: every row's first loss is about ln(vocab) (0.1: init noise)."""
    if "megatron" in name and "megatron" not in backends.names():
        pytest.skip("no megatron backend in twinkle_fn.backends")
    row = cpu_run[0]["rows"][name]
    assert row["status"] == "ok", row
    assert row["tokens_per_s"] > 0 and row["mfu"] is None and row["peak_mem_gib"] is None
    assert row["first_loss"] == pytest.approx(math.log(512), abs=0.1)
    expected = row["tokens_per_s"] / cpu_run[0]["rows"]["hf_loop"]["tokens_per_s"]
    assert row["x_hf_loop"] == pytest.approx(expected)


def test_grouped_and_looped_experts_give_the_same_losses(cpu_run):
    """Same weights, same bf16 products summed in another order: 1e-3 relative."""
    rows = cpu_run[0]["rows"]
    if any(rows[n]["status"] != "ok" for n in _MEGATRON):
        pytest.skip("no megatron backend in twinkle_fn.backends")
    looped, grouped = (rows[n] for n in _MEGATRON)
    assert grouped["first_loss"] == pytest.approx(looped["first_loss"], rel=1e-3)
    assert grouped["last_loss"] == pytest.approx(looped["last_loss"], rel=1e-3)


def test_lora_rows_start_from_the_full_models_loss(cpu_run):
    """The adapters start at B = 0: each LoRA row's first loss is its full row's (same weights,
    same bf16 step; 1e-3 relative)."""
    rows = cpu_run[0]["rows"]
    pairs = [("hf_loop_lora", "hf_loop"), ("twinkle_fsdp_lora", "twinkle_fsdp")]
    if rows["twinkle_megatron_grouped_lora"]["status"] == "ok":
        pairs.append(("twinkle_megatron_grouped_lora", "twinkle_megatron_grouped"))
    for lora, full in pairs:
        assert rows[lora]["first_loss"] == pytest.approx(rows[full]["first_loss"], rel=1e-3)
        assert rows[lora]["x_hf_loop_lora"] == pytest.approx(
            rows[lora]["tokens_per_s"] / rows["hf_loop_lora"]["tokens_per_s"]
        )


def test_active_params_count_the_top_k_experts_of_the_hf_model():
    config = moe.moe_config("tiny", 2)
    model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for n, p in model.named_parameters() if "norm" not in n)
    total -= model.model.embed_tokens.weight.numel()
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts > 0
    share = config.num_experts_per_tok / config.num_experts
    assert moe.active_matmul_params(config) == total - experts + share * experts


def test_issue_shape_and_bad_arguments():
    config = moe.moe_config("qwen3-30b-a3b", 2)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (
        128,
        8,
        768,
    )
    assert (config.hidden_size, config.vocab_size, config.num_hidden_layers) == (2048, 151936, 2)
    with pytest.raises(ValueError, match="unknown shape 'qwen9'"):
        moe.moe_config("qwen9", 2)
    with pytest.raises(ValueError, match="layers must be positive"):
        moe.moe_config("tiny", 0)
