"""Router facts of mixture-of-experts models, defined once for every backend: the load-balancing
(aux) and z losses, each MoE layer's expert load, and routing-replay records.

- `losses`: the router losses (`RouterLoss`, the model option ``"router_loss"``), their
  ``"hf"`` and ``"megatron"`` definitions and how they are normalised over tokens.
- `router_pass`: one forward's router bookkeeping (`RouterPass`), which a backend's router hook
  feeds: the losses' statistics summed over the data ranks, their gradient injected where the
  router's weights are used, and the expert load, ``tf.fwd_bwd``'s ``aux["expert_load"]``.
- `replay`: routing records (``"routed_experts"``, ``[B, T, L, k]``) that
  ``tf.token_logps(..., record_routing=True)`` returns and a batch can carry to route its tokens
  to those experts again.
"""

from twinkle_fn.moe.losses import (
    AUX_KINDS,
    ROUTER_LOSS_OPTION,
    RouterLoss,
    load_balancing_loss,
    router_loss,
    router_scores,
    router_terms,
    z_loss,
)
from twinkle_fn.moe.replay import (
    ROUTED_EXPERTS,
    ROUTER_TOKEN,
    check_record,
    record_part,
    replay_targets,
    token_field,
    token_places,
    with_token_field,
)
from twinkle_fn.moe.router_pass import RouterPass, expert_counts

__all__ = [
    "AUX_KINDS",
    "ROUTED_EXPERTS",
    "ROUTER_LOSS_OPTION",
    "ROUTER_TOKEN",
    "RouterLoss",
    "RouterPass",
    "check_record",
    "expert_counts",
    "load_balancing_loss",
    "record_part",
    "replay_targets",
    "router_loss",
    "router_scores",
    "router_terms",
    "token_field",
    "token_places",
    "with_token_field",
    "z_loss",
]
