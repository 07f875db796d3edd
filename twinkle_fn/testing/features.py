"""Random, deterministic training features for tests: token ids with shifted, partly masked
labels (`random_features`), and the per-token fields the RL and weighted losses read, added
to them (`with_advantages`, `with_value_fields`, `with_rl_fields`, `with_loss_scale`).

Every added number is exact in float32 (collation's dtype for floats), so a float64 reference
sees the same numbers the collated batch holds.
"""

from __future__ import annotations

import random
from typing import Any

import torch


def random_features(
    n: int, *, vocab_size: int = 96, min_len: int = 3, max_len: int = 12, seed: int = 0
) -> list[dict[str, list[int]]]:
    """`n` features of random tokens with shifted labels; about a third of each prompt is masked.

    Every feature has at least one supervised token (the masked prompt is under a third).
    """
    rng = random.Random(seed)
    feats = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        ids = [rng.randrange(1, vocab_size) for _ in range(length)]
        prompt = rng.randint(0, length // 3)
        raw = [-100] * prompt + ids[prompt:]
        feats.append({"input_ids": ids, "labels": [*raw[1:], -100]})
    return feats


def with_advantages(features: list[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """`features`, each with per-token ``advantages`` in ``[-1, 1)`` (the batch field of
    `twinkle_fn.losses.policy_gradient`); the inputs are not modified. Multiples of 1/1024, so
    that float32 (collation's dtype for floats) holds them exactly."""
    rng = random.Random(seed)
    return [
        {**f, "advantages": [rng.randrange(-1024, 1024) / 1024 for _ in f["input_ids"]]}
        for f in features
    ]


def with_value_fields(features: list[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """`features` (not modified) with per-token ``returns`` in ``[-1, 1)`` and ``old_values``
    within 0.375 of a tiny random critic's values (about 0 +- 0.3), so that a clip of 0.2 binds on
    some tokens only. Multiples of 1/1024: exact in float32 (collation's dtype)."""
    rng = random.Random(seed)
    return [
        {
            **f,
            "returns": [rng.randrange(-1024, 1024) / 1024 for _ in f["input_ids"]],
            "old_values": [rng.randrange(-384, 384) / 1024 for _ in f["input_ids"]],
        }
        for f in features
    ]


def with_rl_fields(features: list[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """`features` (not modified) with every field `twinkle_fn.losses.ppo_loss` may read: per-token
    ``advantages`` in ``[-1, 1)``; ``old_logps``, ``ref_logps`` and ``rollout_logps`` in
    ``[-5.5, -3.5)``, around a tiny random model's ``log(1/96)`` so that the clip binds on some
    tokens only; a per-sample ``loss_weights`` of `aggregation_weights`' sequence mean. All
    exact in float32 (collation's dtype), so float64 references see the same numbers."""
    from twinkle_fn.losses import aggregation_weights

    rng = random.Random(seed)
    lengths = [sum(x != -100 for x in f["labels"]) for f in features]
    weights = aggregation_weights(lengths, "seq_mean_token_mean")

    def logps(n: int) -> list[float]:
        return [rng.randrange(-1408, -896) / 256 for _ in range(n)]

    return [
        {
            **f,
            "advantages": [rng.randrange(-1024, 1024) / 1024 for _ in f["input_ids"]],
            "old_logps": logps(len(f["input_ids"])),
            "ref_logps": logps(len(f["input_ids"])),
            "rollout_logps": logps(len(f["input_ids"])),
            "loss_weights": float(torch.tensor(w, dtype=torch.float32)),
        }
        for f, w in zip(features, weights, strict=True)
    ]


def with_loss_scale(features: list[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """`features` (not modified) with a per-token ``loss_scale`` in ``{0, 0.25, ..., 2}`` (zeros
    included; exact in float32, collation's dtype)."""
    rng = random.Random(seed)
    return [{**f, "loss_scale": [rng.randrange(9) / 4 for _ in f["input_ids"]]} for f in features]
