"""`twinkle.cli.CLI.from_args`: upstream's cookbook flags land in their groups, converted to
the field's type, with environment variables and a YAML file under them."""

import pytest

from twinkle.cli import CLI, Args

# the flags of upstream's cookbook/transformers/fsdp2.sh, with a switch and a negated one
FSDP2_SH = [
    "--model-id", "ms://Qwen/Qwen3.5-4B",
    "--dataset-id", "ms://swift/self-cognition",
    "--template-cls", "Qwen3_5Template",
    "--fsdp-size", "2",
    "--dp-size", "4",
    "--batch-size", "8",
    "--lr", "1e-4",
    "--gradient-accumulation-steps", "2",
    "--eval-samples", "100",
    "--output-dir", "./output/fsdp2",
    "--adapter-name", "default",
    "--scheduler-cls", "CosineWarmupScheduler",
    "--num-warmup-steps", "5",
    "--model-name", "twinkle大模型",
    "--sequence-parallel",
    "--no-enable-fused-ce",
]  # fmt: skip


def test_upstream_flags_fill_their_groups():
    args = CLI.from_args(FSDP2_SH, environ={})
    assert isinstance(args, Args)
    assert args.model.model_id == "ms://Qwen/Qwen3.5-4B"
    assert args.dataset.dataset_id == "ms://swift/self-cognition"
    assert args.template.template_cls == "Qwen3_5Template"
    assert (args.infra.fsdp_size, args.infra.dp_size) == (2, 4)
    assert args.training.batch_size == 8 and args.training.gradient_accumulation_steps == 2
    assert args.optimizer.learning_rate == 1e-4  # --lr is learning_rate
    assert args.scheduler.scheduler_cls == "CosineWarmupScheduler"
    assert args.scheduler.num_warmup_steps == 5
    assert args.infra.sequence_parallel is True and args.model.enable_fused_ce is False
    assert args.extra == {"model_name": "twinkle大模型"}  # no group knows it
    # unset fields keep upstream's defaults
    assert args.infra.mode == "local" and args.training.eval_interval is None
    assert args.checkpoint.save_optimizer is True and args.template.max_length == 8192


def test_lora_args_and_lists():
    args = CLI.from_args(["--lora-r", "4", "--lora-target-modules", "q_proj, v_proj"], environ={})
    assert args.get_lora_args() == {
        "target_modules": ["q_proj", "v_proj"],
        "r": 4,
        "lora_alpha": 32,
        "lora_dropout": 0.05,
    }
    assert CLI.from_args([], environ={}).get_lora_args()["target_modules"] == "all-linear"


def test_sources_in_order_env_yaml_flags(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("training:\n  batch_size: 16\n  log_interval: 5\nlr: 0.01\n")
    env = {"TWINKLE_BATCH_SIZE": "4", "TWINKLE_SEED": "7", "TWINKLE_UNRELATED": "x"}
    args = CLI.from_args(["--config", str(config), "--log-interval", "3"], environ=env)
    assert args.training.seed == 7  # environment
    assert args.training.batch_size == 16  # the YAML file over the environment
    assert args.optimizer.learning_rate == 0.01
    assert args.training.log_interval == 3  # the flags over the YAML file
    assert "unrelated" not in args.extra  # TWINKLE_ variables name fields only


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--batch-size", "eight"], "--batch-size: 'eight' is not a int"),
        (["--batch-size", "2.5"], "--batch-size: '2.5' is not a int"),
        (["--mode", "cluster"], "--mode: 'cluster' is not one of 'local', 'ray'"),
        (["--sequence-parallel", "maybe"], "--sequence-parallel: 'maybe' is not a bool"),
        (["model.py"], "argument 'model.py' is not a --flag"),
    ],
)
def test_bad_values_name_the_flag(argv, match):
    with pytest.raises(ValueError, match=match):
        CLI.from_args(argv, environ={})


def test_bad_config_file_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"--config .*missing.yaml: cannot read it"):
        CLI.from_args(["--config", str(tmp_path / "missing.yaml")], environ={})
