"""Losses as token sums plus token counts; the caller takes the mean once over all of them."""

from twinkle_fn.losses.cross_entropy import LossOutput, cross_entropy_sum, token_logps
from twinkle_fn.losses.fused_linear_ce import (
    TokenLossOutput,
    fused_linear_cross_entropy_sum,
    supervised_rows,
)

__all__ = [
    "LossOutput",
    "TokenLossOutput",
    "cross_entropy_sum",
    "fused_linear_cross_entropy_sum",
    "supervised_rows",
    "token_logps",
]
