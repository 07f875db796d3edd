"""Small, deterministic models and data for tests (no download, seconds on a CPU).

- `configs`: `tiny_config`, a 2-layer, hidden-32 config of every model family.
- `features`: `random_features` and the per-token fields the RL and weighted losses read
  (`with_advantages`, `with_value_fields`, `with_rl_fields`, `with_loss_scale`).
- `loss_references`: float64 references of the token and sequence losses, in value and
  gradient, over a plain HF forward (`policy_gradient_reference`, `ppo_reference`,
  `value_reference`, `preference_reference`, `weighted_ce_reference` and their pieces).
- `moe_reference`: the MoE router losses and expert load written from transformers' and
  megatron-core's formulas (`router_reference`).
- `accelerator_checks`: Triton kernels under the CPU interpreter, float8 loss bounds, CUDA
  host-sync detection.
- `op_records`: `op_shapes`, the output shapes of one aten op while a block runs.

Multi-rank helpers (spawning gloo ranks) are in `twinkle_fn.testing_dist`.
"""

from twinkle_fn.testing.accelerator_checks import (
    assert_within_float8_rounding,
    no_host_sync,
    run_triton_interpreted,
)
from twinkle_fn.testing.configs import tiny_config
from twinkle_fn.testing.features import (
    random_features,
    with_advantages,
    with_loss_scale,
    with_rl_fields,
    with_value_fields,
)
from twinkle_fn.testing.loss_references import (
    policy_gradient_reference,
    ppo_reference,
    ppo_reference_terms,
    preference_reference,
    preference_reference_losses,
    value_reference,
    value_reference_sum,
    weighted_ce_reference,
)
from twinkle_fn.testing.moe_reference import router_reference
from twinkle_fn.testing.op_records import op_shapes

__all__ = [
    "assert_within_float8_rounding",
    "no_host_sync",
    "op_shapes",
    "policy_gradient_reference",
    "ppo_reference",
    "ppo_reference_terms",
    "preference_reference",
    "preference_reference_losses",
    "random_features",
    "router_reference",
    "run_triton_interpreted",
    "tiny_config",
    "value_reference",
    "value_reference_sum",
    "weighted_ce_reference",
    "with_advantages",
    "with_loss_scale",
    "with_rl_fields",
    "with_value_fields",
]
