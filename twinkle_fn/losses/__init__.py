"""Losses as token sums plus token counts; the caller takes the mean once over all of them."""

from twinkle_fn.losses.advantages import group_advantages
from twinkle_fn.losses.cross_entropy import LossOutput, cross_entropy_sum, token_logps
from twinkle_fn.losses.fused_linear_ce import (
    TokenLossOutput,
    fused_linear_cross_entropy_sum,
    supervised_rows,
)
from twinkle_fn.losses.ppo import ClippedSurrogate, aggregation_weights, ppo_loss
from twinkle_fn.losses.preference import (
    LinearisedPairs,
    PreferenceLoss,
    dpo_loss,
    sequence_index,
    simpo_loss,
)
from twinkle_fn.losses.token_loss import (
    PolicyGradient,
    SequenceLoss,
    TokenInputs,
    TokenLoss,
    check_head,
    check_loss,
    is_sequence_loss,
    policy_gradient,
    token_entropy,
    token_loss,
)
from twinkle_fn.losses.value import ValueLoss, value_loss
from twinkle_fn.losses.weighted_ce import WeightedCrossEntropy, weighted_cross_entropy

__all__ = [
    "ClippedSurrogate",
    "LinearisedPairs",
    "LossOutput",
    "PolicyGradient",
    "PreferenceLoss",
    "SequenceLoss",
    "TokenInputs",
    "TokenLoss",
    "TokenLossOutput",
    "ValueLoss",
    "WeightedCrossEntropy",
    "aggregation_weights",
    "check_head",
    "check_loss",
    "cross_entropy_sum",
    "dpo_loss",
    "fused_linear_cross_entropy_sum",
    "group_advantages",
    "is_sequence_loss",
    "policy_gradient",
    "ppo_loss",
    "sequence_index",
    "simpo_loss",
    "supervised_rows",
    "token_entropy",
    "token_logps",
    "token_loss",
    "value_loss",
    "weighted_cross_entropy",
]
