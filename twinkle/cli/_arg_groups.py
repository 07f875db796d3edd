"""The groups of upstream's script arguments (`Args`): one dataclass per group of settings.

Each field is one setting with upstream's name, type and default; a field's type hint is what
`twinkle.cli.args` converts a flag's value to (a ``Literal`` lists its choices). `Args` holds
one of each group, and ``extra``: the keys that no group knows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class ModelArgs:
    """What model to train and how it is built (`model_id`: a local directory or hub id)."""

    model_id: str | None = None
    model_cls: str | None = None
    tokenizer_id: str | None = None
    mixed_precision: Literal["no", "fp8", "fp16", "bf16"] = "bf16"
    strategy: Literal["accelerate", "native_fsdp"] = "accelerate"
    memory_efficient_init: bool = False
    gradient_checkpointing: bool = True
    trust_remote_code: bool = True
    load_weights: bool = True
    recompute_granularity: str | None = "full"
    recompute_method: str | None = "uniform"
    recompute_num_layers: int | None = 1
    recompute_modules: list[str] | None = None
    use_distributed_optimizer: bool = True
    variable_seq_lengths: bool = True
    enable_liger: bool = False
    enable_fused_ce: bool = True


@dataclass
class LoraArgs:
    """The LoRA adapter (`get_lora_args` gives peft's ``LoraConfig`` fields)."""

    use_lora: bool = False
    lora_r: int = 8
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_target_modules: list[str] | None = None
    adapter_name: str = "default"
    lora_path: str | None = None


@dataclass
class DatasetArgs:
    dataset_id: str = ""
    subset_name: str = "default"
    split: str = "train"
    streaming: bool = False
    num_proc: int | None = None
    data_slice: str | None = None
    revision: str | None = None


@dataclass
class TemplateArgs:
    template_cls: str | None = None
    model_id: str | None = None
    max_length: int = 8192
    truncation_strategy: Literal["raise", "left", "right", "split", "delete"] = "raise"
    use_chat_template: bool = True
    enable_thinking: bool = True
    default_system: str | None = None


@dataclass
class TrainingArgs:
    max_steps: int = 200
    num_train_epochs: int | None = None
    batch_size: int = 8
    mini_batch_size: int | None = None
    micro_batch_size: int = 2
    gradient_accumulation_steps: int = 1
    output_dir: str = "./output"
    save_steps: int = 50
    save_total_limit: int | None = None
    log_interval: int = 10
    eval_interval: int | None = None
    eval_samples: int | None = None
    train_samples: int | None = None
    resume_from_checkpoint: str | None = None
    resume_only_model: bool = False
    ignore_data_skip: bool = False
    seed: int = 42
    full_determinism: bool = False
    padding_free: bool = False


@dataclass
class OptimizerArgs:
    optimizer_cls: str = "AdamW"
    learning_rate: float = 1e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0


@dataclass
class SchedulerArgs:
    scheduler_cls: str = "CosineAnnealingLR"
    num_warmup_steps: int = 0
    num_training_steps: int | None = None
    t_max: int | None = None
    eta_min: float = 0.0
    lr_decay_steps: int | None = None
    max_lr: float | None = None


@dataclass
class LossArgs:
    loss_cls: str = "CrossEntropyLoss"
    loss_type: str = "sigmoid"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.1
    sft_weight: float = 1.0
    entropy_coef: float = 0.0
    ignore_index: int = -100


@dataclass
class SamplerArgs:
    sampler_type: str = "vLLMSampler"
    gpu_memory_utilization: float = 0.8
    max_model_len: int | None = None
    tensor_parallel_size: int | None = None
    enable_lora: bool = False
    max_lora_rank: int = 32
    enforce_eager: bool = False


@dataclass
class SamplingArgs:
    max_tokens: int | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    num_samples: int = 1
    logprobs: int | None = None
    seed: int | None = None
    stop: str | None = None


@dataclass
class InfraArgs:
    """How the run is laid out: `mode` (``local``: torchrun; ``ray``) and the mesh sizes."""

    mode: Literal["local", "ray"] = "local"
    nproc_per_node: int = 8
    ncpu_proc_per_node: int = 8
    model_gpus: int | None = None
    sampler_gpus: int | None = None
    ref_model_gpus: int | None = None
    world_size: int | None = None
    dp_size: int | None = None
    fsdp_size: int | None = None
    tp_size: int | None = None
    pp_size: int | None = None
    cp_size: int | None = None
    ep_size: int | None = None
    etp_size: int | None = None
    ep_fsdp_size: int | None = None
    vpp_size: int | None = None
    ulysses_size: int | None = None
    sequence_parallel: bool = False
    lazy_collect: bool = True


@dataclass
class ServerArgs:
    config: str | None = None
    ray_namespace: str = "twinkle_cluster"
    host: str = "0.0.0.0"
    port: int = 8000
    log_level: str = "INFO"


@dataclass
class RLArgs:
    num_generations: int = 8
    advantage_type: str = "GRPOAdvantage"
    advantage_scale: Literal["group", "batch", "none"] = "group"
    reward_fns: list[str] | None = None
    student_model_id: str | None = None
    teacher_model_id: str | None = None
    gkd_beta: float = 0.5
    gkd_temperature: float = 1.0
    gkd_topk: int = 64
    router_replay_mode: Literal["disabled", "R2", "R3"] = "disabled"


@dataclass
class CheckpointArgs:
    save_optimizer: bool = True
    merge_and_sync: bool = True
    platform: str = "GPU"
    lora_sync_dir: str | None = None


@dataclass
class Args:
    """Every group of a script's settings, and ``extra``: the keys no group knows."""

    model: ModelArgs = field(default_factory=ModelArgs)
    lora: LoraArgs = field(default_factory=LoraArgs)
    dataset: DatasetArgs = field(default_factory=DatasetArgs)
    template: TemplateArgs = field(default_factory=TemplateArgs)
    training: TrainingArgs = field(default_factory=TrainingArgs)
    optimizer: OptimizerArgs = field(default_factory=OptimizerArgs)
    scheduler: SchedulerArgs = field(default_factory=SchedulerArgs)
    loss: LossArgs = field(default_factory=LossArgs)
    sampler: SamplerArgs = field(default_factory=SamplerArgs)
    sampling: SamplingArgs = field(default_factory=SamplingArgs)
    infra: InfraArgs = field(default_factory=InfraArgs)
    server: ServerArgs = field(default_factory=ServerArgs)
    rl: RLArgs = field(default_factory=RLArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    extra: dict[str, Any] = field(default_factory=dict)

    def get_lora_args(self) -> dict[str, Any]:
        """peft ``LoraConfig`` keyword arguments: ``target_modules`` (default
        ``'all-linear'``), ``r``, ``lora_alpha``, ``lora_dropout``."""
        return {
            "target_modules": self.lora.lora_target_modules or "all-linear",
            "r": self.lora.lora_r,
            "lora_alpha": self.lora.lora_alpha,
            "lora_dropout": self.lora.lora_dropout,
        }

    def get(self, key: str, default: Any = None) -> Any:
        """The value of `key` in whichever group has it (the first in field order), else
        ``extra[key]``, else `default`."""
        for name in GROUPS:
            group = getattr(self, name)
            if hasattr(group, key):
                return getattr(group, key)
        return self.extra.get(key, default)

    def to_dict(self) -> dict[str, Any]:
        """Every group's fields (and ``extra``) in one flat mapping."""
        flat: dict[str, Any] = {}
        for name in GROUPS:
            flat.update(dataclasses.asdict(getattr(self, name)))
        flat.update(self.extra)
        return flat


# The groups in field order: where `Args.get` looks for a key, first match winning.
GROUPS = tuple(f.name for f in dataclasses.fields(Args) if f.name != "extra")
