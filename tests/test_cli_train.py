"""`twinkle train` end to end on CPU: outputs, learning, and bad input."""

import contextlib
import io
import json
import re
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from twinkle.cli import main

SMALL = ["--steps", "40", "--batch-size", "16", "--num-samples", "400", "--no-progress"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    assert main(["train", *SMALL, "--output-dir", str(out)]) == 0
    return out


def test_writes_summary_plot_and_loadable_checkpoint(run_dir):
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 40 and summary["tokens_per_s"] > 0
    png = (run_dir / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000
    ckpt = run_dir / "checkpoint"
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    tok = AutoTokenizer.from_pretrained(ckpt)
    ids = tok("What is 1 + 2?", return_tensors="pt").input_ids
    assert torch.isfinite(model(input_ids=ids).logits).all()


def test_heldout_loss_falls(run_dir):
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["heldout_loss_after"] < 0.6 * summary["heldout_loss_before"]


def test_jsonl_text_and_messages_rows(tmp_path):
    data = tmp_path / "d.jsonl"
    rows = [{"text": f"row {i} says hello"} for i in range(20)]
    rows += [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    ] * 20
    data.write_text("\n".join(json.dumps(r) for r in rows))
    args = ["train", "--data", str(data), "--steps", "3", "--batch-size", "4", "--no-progress"]
    assert main([*args, "--output-dir", str(tmp_path / "o")]) == 0


def test_model_directory_is_reused(run_dir, tmp_path):
    args = ["train", "--model", str(run_dir / "checkpoint"), "--steps", "3"]
    args += ["--batch-size", "4", "--num-samples", "100", "--no-progress"]
    assert main([*args, "--output-dir", str(tmp_path)]) == 0


def test_bad_rows_are_named(tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"text": "ok"}\n{"prompt": "no field"}\n')
    assert main(["train", "--data", str(data), "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:2" in err and "messages" in err and "text" in err


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"", r"empty\.jsonl: no rows \(the file is empty or blank\)"),
        (b'{"text": "ok"}\n\x1f\x8b\x08\x00', r"empty\.jsonl:2: not UTF-8 text \(byte 0x8b"),
    ],
)
def test_empty_or_binary_data_file_is_named_before_training(tmp_path, capsys, content, match):
    data = tmp_path / "empty.jsonl"
    data.write_bytes(content)
    assert main(["train", "--data", str(data), "--output-dir", str(tmp_path / "o")]) == 2
    assert re.search(match, capsys.readouterr().err)
    assert not (tmp_path / "o").exists()


def test_non_numeric_lr_is_named(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--lr", "fast"])
    assert "--lr" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--lr", "0"], "--lr must be a positive finite number, got 0.0: .*--lr 3e-3"),
        (
            ["--warmup-steps", "50", "--steps", "3"],
            r"--warmup-steps 50 must be < --steps 3: .*lower --warmup-steps \(e.g. 0\) or raise",
        ),
        (["--warmup-steps", "3", "--steps", "3"], "--warmup-steps 3 must be < --steps 3"),
        (["--weight-decay", "-1"], r"--weight-decay must be a finite number >= 0, got -1.0"),
    ],
)
def test_zero_lr_and_warmup_past_the_run_are_refused_before_training(args, match, tmp_path, capsys):
    """The library's policy (an lr <= 0 and a warmup not shorter than the schedule are refused):
    the warmup was silently clamped to steps - 1 before."""
    assert main(["train", *args, "--no-progress", "--output-dir", str(tmp_path / "o")]) == 2
    assert re.search(match, capsys.readouterr().err)
    assert not (tmp_path / "o").exists()


def test_model_without_tokenizer_is_named(run_dir, tmp_path, capsys):
    model = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoint")
    model.save_pretrained(tmp_path / "m")
    assert main(["train", "--model", str(tmp_path / "m"), "--output-dir", str(tmp_path)]) == 2
    assert "tokenizer" in capsys.readouterr().err


def test_batch_larger_than_data_is_named(tmp_path, capsys):
    args = ["train", "--num-samples", "20", "--batch-size", "64", "--output-dir", str(tmp_path)]
    assert main(args) == 2
    assert "--batch-size" in capsys.readouterr().err


def _train_counting_tokens(out, *mesh):
    """`twinkle train` (4 steps, `mesh` args) on this rank, counting the tokens it feeds to
    tf.fwd_bwd; returns the exit code, that count and what it printed."""
    import twinkle_fn

    fed = []
    fwd_bwd = twinkle_fn.fwd_bwd

    def counting(state, batch, **kwargs):
        fed.append(batch["input_ids"].numel())  # packed: [1, tokens of the micro-batch]
        return fwd_bwd(state, batch, **kwargs)

    twinkle_fn.fwd_bwd = counting
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["train", *SMALL, "--steps", "4", *mesh, "--output-dir", str(out)])
    twinkle_fn.fwd_bwd = fwd_bwd
    return code, sum(fed), printed.getvalue()


def _train_on_two_ranks(out):
    """What `torchrun --nproc-per-node 2 -m twinkle.cli train` runs, without and with
    ``--mesh fsdp=2``."""
    return [
        _train_counting_tokens(out / "dp"),
        _train_counting_tokens(out / "fsdp", "--mesh", "fsdp=2"),
    ]


def test_two_ranks_under_a_launcher_split_every_batch(tmp_path):
    """2 gloo ranks, without --mesh (data parallel over the world, said at the start) and with
    fsdp=2. Each rank feeds only its slice of every batch (before: the whole batch on each rank,
    a replica with twice the compute), the two slices are the one-process run's tokens, and the
    weights are the one-process run's (float32: the same sums in another order over 4 Adam
    steps; observed max difference 1.2e-7, one ulp of the norm weights ~1.0). Key biases are the
    exception: softmax ignores a bias added to every key, so their gradient is rounding noise,
    which Adam scales into steps that follow the noise (observed up to 1.1e-6 on values ~3e-3)."""
    from twinkle_fn.testing_dist import spawn

    ranks = spawn(_train_on_two_ranks, 2, tmp_path)
    one = _train_counting_tokens(tmp_path / "one")
    assert one[0] == 0 and "no --mesh given" not in one[2]
    assert "no --mesh given; data parallel over the world: dp=2" in ranks[0][0][2]
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "one" / "checkpoint").state_dict()
    for run, name in enumerate(["dp", "fsdp"]):
        codes, fed = [r[run][0] for r in ranks], [r[run][1] for r in ranks]
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert codes == [0, 0] and summary["steps"] == 4
        assert summary["heldout_loss_after"] < summary["heldout_loss_before"]
        assert sum(fed) == one[1] == summary["train_tokens"] and 0 < min(fed) < 0.6 * one[1]
        two = AutoModelForCausalLM.from_pretrained(tmp_path / name / "checkpoint").state_dict()
        for key, weight in ref.items():
            atol = 1e-5 if key.endswith("k_proj.bias") else 1e-6
            torch.testing.assert_close(two[key], weight, rtol=0, atol=atol, msg=key)


def test_fewer_samples_per_data_rank_than_micro_batches_is_named(tmp_path, capsys):
    args = ["train", "--batch-size", "2", "--micro-batches", "3", "--output-dir", str(tmp_path)]
    assert main(args) == 2
    assert (
        "--batch-size 2 over 1 data ranks (one process) leaves 2 samples per rank, fewer "
        "than --micro-batches 3; raise --batch-size to at least 3" in capsys.readouterr().err
    )


def test_max_length_past_the_models_positions_is_refused(tmp_path, capsys):
    """The tiny default model has 512 positions; before, --max-length 600 was taken as is."""
    assert main(["train", "--max-length", "600", "--output-dir", str(tmp_path)]) == 2
    assert (
        "--max-length 600 exceeds the model's max_position_embeddings (512); pass "
        "--max-length 512 or less" in capsys.readouterr().err
    )


def test_bad_mesh_is_named(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--mesh", "dp=two"])
    assert "--mesh" in capsys.readouterr().err


def test_divergence_stops_naming_the_step_and_keeps_the_good_checkpoint(run_dir, tmp_path, capsys):
    shutil.copytree(run_dir / "checkpoint", tmp_path / "checkpoint")
    before = {p.name: p.read_bytes() for p in (tmp_path / "checkpoint").iterdir() if p.is_file()}
    args = ["train", *SMALL, "--steps", "6", "--lr", "1e30", "--output-dir", str(tmp_path)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "diverged" in err and re.search(r"step \d+: loss (nan|inf)", err), err
    after = {p.name: p.read_bytes() for p in (tmp_path / "checkpoint").iterdir() if p.is_file()}
    assert after == before
