"""The raw megatron-core baseline of `benchmarks.throughput`'s ``mcore_*`` rows: a bf16
``GPTModel`` (megatron-core's local layer spec, or twinkle's SDPA one), DDP, the distributed
optimizer and ``get_forward_backward_func``, with megatron-core's own defaults."""

from __future__ import annotations

import torch

from benchmarks.timing import Step
from benchmarks.training import CLIP, LR, WEIGHT_DECAY, Setup
from twinkle_fn.mesh import Mesh


def mcore_step(setup: Setup, our_spec: bool) -> Step:
    """megatron-core's own training path: bf16 GPTModel, DDP, distributed optimizer; with
    `our_spec`, twinkle's SDPA layer spec instead of megatron-core's local one. Needs a
    `benchmarks.training.megatron_world`."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from twinkle_fn.backends.megatron.bridge_transforms import padded_vocab_size
    from twinkle_fn.backends.megatron.config import transformer_config
    from twinkle_fn.backends.megatron.model import build_gpt_model, rope_settings

    cfg, mesh = setup.config, Mesh()
    # megatron-core's own defaults for its fusions (all off), not the twinkle backend's (on with
    # CUDA), so that these rows stay the raw baseline measured before the backend gained them.
    kw = dict(
        params_dtype=torch.bfloat16,
        bf16=True,
        finalize_model_grads_func=finalize_model_grads,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        persist_layer_norm=False,
    )
    if our_spec:
        model = build_gpt_model(cfg, mesh, **kw)
    else:
        model = GPTModel(
            transformer_config(cfg, mesh, **kw),
            get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=padded_vocab_size(cfg.vocab_size, 1),
            max_sequence_length=cfg.max_position_embeddings,
            share_embeddings_and_output_weights=bool(cfg.tie_word_embeddings),
            position_embedding_type="rope",
            rotary_base=rope_settings(cfg)[0],
        ).to(setup.device)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True
    )
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=LR,
            weight_decay=WEIGHT_DECAY,
            bf16=True,
            use_distributed_optimizer=True,
            clip_grad=CLIP,
        ),
        [ddp],
    )
    ids = setup.input_ids  # [batch, seq]
    batch, seq = ids.shape
    positions = torch.arange(seq, device=ids.device).expand(batch, seq)
    labels = ids.roll(-1, dims=1)  # the next token; the wrapped last column is masked out
    mask = torch.ones(batch, seq, device=ids.device)
    mask[:, -1] = 0
    forward_backward = get_forward_backward_func()

    def loss_func(per_token: torch.Tensor):
        loss_sum = (per_token.float() * mask).sum()
        num = mask.sum().to(torch.int)
        return loss_sum, num, {"loss": (loss_sum / num).detach()}

    def forward_step(_, module):
        return module(ids, positions, None, labels=labels), loss_func

    def step() -> torch.Tensor:
        ddp.zero_grad_buffer()
        opt.zero_grad()
        out = forward_backward(
            forward_step_func=forward_step,
            data_iterator=None,
            model=[ddp],
            num_microbatches=1,
            seq_length=seq,
            micro_batch_size=batch,
        )
        opt.step()
        return out[0]["loss"]

    return step
