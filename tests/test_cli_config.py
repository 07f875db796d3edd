"""`twinkle train --config`: the run description, its sources and its checks (no training)."""

import argparse
import re

import pytest

from twinkle.cli import config as cfg
from twinkle.cli import main, train


def _run_config(argv: list[str]) -> cfg.RunConfig:
    parser = argparse.ArgumentParser()
    train.add_parser(parser.add_subparsers())
    return train.run_config(parser.parse_args(["train", *argv]))


def test_file_then_flags_then_set(tmp_path):
    """YAML reads ``3e-3`` as a string; the float field converts it. A flag overrides the file,
    ``--set`` overrides both; untouched keys keep the file's value or the default."""
    path = tmp_path / "run.yaml"
    path.write_text("optimizer:\n  lr: 3e-3\n  weight_decay: 0.0\nschedule:\n  steps: 50\n")
    config = _run_config(["--config", str(path), "--steps", "7", "--set", "schedule.steps=9"])
    assert config.optimizer.lr == 3e-3 and config.optimizer.weight_decay == 0.0
    assert config.schedule.steps == 9 and config.data.batch_size == 32
    assert _run_config(["--config", str(path), "--steps", "7"]).schedule.steps == 7


def test_backend_and_lora_flags_fill_the_same_tree():
    config = _run_config(["--backend", "megatron", "--lora", "r=8,alpha=16,targets=all-linear"])
    assert config.backend == "megatron"
    assert config.lora == cfg.LoraConfig(r=8, alpha=16, targets="all-linear")
    assert _run_config([]).lora is None


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"optimizer": {"lrr": 1}}, r"unknown key 'optimizer\.lrr'; did you mean optimizer\.lr\?"),
        ({"cadense": {}}, r"unknown key 'cadense'; did you mean cadence\?"),
        (
            {"backend": "megatron", "megatron": {"tensor_model_paralel_size": 2}},
            r"'megatron\.tensor_model_paralel_size'; did you mean "
            r"megatron\.tensor_model_parallel_size\?",
        ),
        ({"data": {"batch_size": "many"}}, r"data\.batch_size: 'many' is not of type int"),
        ({"data": {"batch_size": 2.5}}, r"data\.batch_size: 2\.5 is not of type int"),
        ({"backend": "jax"}, r"backend: 'jax' is not one of transformers, megatron"),
        (
            {"megatron": {"param_offload": True}},
            r"megatron block \(megatron\.\{param_offload\}\) is megatron's and backend is "
            r"'transformers'; set backend: megatron, or remove the megatron block",
        ),
        (
            {"backend": "megatron", "megatron": {"use_dist_checkpointing": True}},
            r"dist_checkpointing_path is null",
        ),
    ],
)
def test_bad_keys_and_values_are_named(raw, match):
    with pytest.raises(ValueError, match=match):
        cfg.build(raw)


def test_the_documents_megatron_block_is_accepted_as_written():
    """The block of the upstream Megatron document (seeds/002), verbatim."""
    block = {
        "tensor_model_parallel_size": 2,
        "pipeline_model_parallel_size": 1,
        "expert_model_parallel_size": 1,
        "param_offload": False,
        "grad_offload": False,
        "optimizer_offload": False,
        "use_mbridge": False,
        "use_dist_checkpointing": False,
        "dist_checkpointing_path": None,
        "override_transformer_config": {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
        },
    }
    config = cfg.build({"backend": "megatron", "megatron": block})
    assert cfg.to_dict(config)["megatron"] == block


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--set", "optimizer.betas=1"], r"unknown key 'optimizer\.betas'"),
        (["--set", "lr"], r"--set 'lr': write key=value"),
        (["--resume", "{tmp}/nothing"], r"--resume {tmp}/nothing: not a twinkle checkpoint"),
        (["--resume", "latest"], r"--resume latest: no complete checkpoint under {tmp}/o"),
        (
            [
                "--backend",
                "megatron",
                "--mesh",
                "tp=2",
                "--set",
                "megatron.pipeline_model_parallel_size=2",
            ],
            r"mesh tp=2 disagrees with the megatron block \(tp=1, pp=2, ep=1\)",
        ),
        (["--mesh", "dp=3"], r"does not match|world"),
    ],
)
def test_bad_input_is_refused_before_anything_is_built(argv, match, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["train", *argv, "--output-dir", str(tmp_path / "o")]) == 2
    assert re.search(match.replace("{tmp}", re.escape(str(tmp_path))), capsys.readouterr().err)
    assert not (tmp_path / "o").exists()


def test_fp8_key_reaches_the_model_option():
    """``fp8`` (a key, ``--set fp8=rowwise``) becomes the model option of that name; other
    values are refused before anything is built. The facade's recipe list is the core's."""
    from twinkle_fn.backends.fp8 import RECIPES

    assert cfg.FP8_RECIPES == RECIPES
    assert _run_config([]).fp8 is None
    config = _run_config(["--set", "fp8=rowwise"])
    model, _ = train._model_and_tokenizer(config)
    assert model.options == {"fp8": "rowwise"}
    assert train._model_and_tokenizer(_run_config([]))[0].options == {}
    with pytest.raises(ValueError, match=r"fp8: 'e4m3' is not one of rowwise, tensorwise"):
        cfg.build({"fp8": "e4m3"})
    stored = _run_config(["--set", "fp8=tensorwise", "--set", "fp8_store_frozen=true"])
    assert train._model_and_tokenizer(stored)[0].options == {
        "fp8": "tensorwise",
        "fp8_store_frozen": True,
    }
    with pytest.raises(ValueError, match=r"fp8_store_frozen: true stores .* set fp8 too"):
        cfg.build({"fp8_store_frozen": True})
