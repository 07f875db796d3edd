"""Tests of `twinkle_fn.moe.replay`'s token bookkeeping: the token field names every batch place
once (padding negated, a backend's padding 0), and a routing record taken apart over two "ranks"
and put back together is the one routed (integer data: exact). The record checks' refusals are
tested through the backends (``backends/transformers/router_test.py``)."""

from __future__ import annotations

import torch

from twinkle_fn.moe.losses import RouterLoss
from twinkle_fn.moe.replay import record_part, replay_targets, token_field, token_places
from twinkle_fn.moe.router_pass import RouterPass

B, T, L, K, E = 2, 3, 2, 2, 4


def test_token_field_names_each_place_and_token_places_inverts_it() -> None:
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    field = token_field({"input_ids": ids, "attention_mask": mask})
    assert field.tolist() == [[1, 2, -3], [4, 5, 6]]
    packed = token_field({"input_ids": ids, "attention_mask": mask, "cu_seqlens": None})
    assert packed.tolist() == [[1, 2, 3], [4, 5, 6]]
    # a backend pads the flattened field with 0 (not a batch token)
    index, valid, present = token_places(torch.cat([field.reshape(-1), torch.zeros(2).long()]))
    assert index.tolist() == [0, 1, 2, 3, 4, 5, 0, 0]
    assert valid.tolist() == [True, True, False, True, True, True, False, False]
    assert present.tolist() == [True] * 6 + [False, False]


def test_a_record_split_over_two_ranks_sums_back_to_the_routing() -> None:
    g = torch.Generator().manual_seed(0)
    routed = torch.rand(B * T, L, E, generator=g).topk(K, -1).indices.sort(-1).values  # [n, L, k]
    parts = []
    for places in (torch.tensor([0, 2, 5]), torch.tensor([1, 3, 4])):  # each rank's tokens
        rp = RouterPass(L, E, K, RouterLoss(), "softmax", record=True)
        for layer in range(L):
            rp.observe(layer, torch.zeros(len(places), E), routed[places, layer], None)
        present = torch.ones(len(places), dtype=torch.bool)
        parts.append(record_part(rp, B * T, present, places))
    record = (parts[0] + parts[1] - 1).view(B, T, L, K)
    assert torch.equal(record.view(-1, L, K), routed)
    index = torch.tensor([4, 1])
    assert torch.equal(replay_targets(record, index), routed[index].permute(1, 0, 2))
