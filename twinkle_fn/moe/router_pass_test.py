"""Tests of `twinkle_fn.moe.router_pass`: expert counts, and the `RouterPass` gradient against
autograd through a whole-batch reference, on one and two ranks."""

from __future__ import annotations

import pytest
import torch

from twinkle_fn.moe.losses import RouterLoss, load_balancing_loss, z_loss
from twinkle_fn.moe.losses_test import E, K, L, N, _logits, _stats
from twinkle_fn.moe.router_pass import RouterPass, expert_counts


def test_expert_counts_match_topk() -> None:
    idx = _logits(3)[0].topk(K, -1).indices
    valid = torch.arange(N) < 7
    ref = torch.bincount(idx[:7].reshape(-1), minlength=E).double()
    torch.testing.assert_close(expert_counts(idx, valid, E), ref)


def _reference(logits: torch.Tensor, valid: torch.Tensor, loss: RouterLoss, n_f: float):
    """``n_f * (aux_coef * aux + z_coef * z)`` straight from the concatenated logits."""
    counts, probs, lse = _stats(logits, valid)
    t = valid.sum()
    aux = load_balancing_loss(counts, probs, t, K, loss.aux_kind)
    return n_f * (loss.aux_coef * aux + loss.z_coef * z_loss(lse, t, loss.aux_kind))


@pytest.mark.parametrize("kind", ["hf", "megatron"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_router_pass_gradient_equals_reference(kind: str, ranks: int) -> None:
    """Each "rank" holds its tokens' logits; a simulated all-reduce sums the statistics.
    The gradient `attach` injects equals autograd's through the whole-batch loss (float64:
    1e-12)."""
    loss = RouterLoss(aux_coef=0.05, aux_kind=kind, z_coef=0.01)
    logits = _logits(4).requires_grad_(True)
    valid = torch.ones(N, dtype=torch.bool)
    valid[-2:] = False
    n_f = 7.0
    ref_grad = torch.autograd.grad(_reference(logits, valid, loss, n_f), logits)[0]

    parts = torch.arange(N).chunk(ranks)
    passes = [RouterPass(L, E, K, loss, "softmax") for _ in parts]
    outs = []
    for rp, rows in zip(passes, parts, strict=True):
        for layer in range(L):
            x = logits[layer, rows]
            top = x.topk(K, -1).indices
            rp.observe(layer, x, top, valid[rows])
            w = torch.ones(len(rows), K, dtype=torch.float64, requires_grad=True)
            outs.append(rp.attach(layer, w, x, valid[rows]).sum())
    share = torch.tensor(n_f / ranks)
    total = sum(rp.statistics(share) for rp in passes)  # what the all-reduce returns
    for rp in passes:
        rp.finish(share, None if ranks == 1 else lambda flat: flat.copy_(total))
    (grad,) = torch.autograd.grad(sum(outs), logits)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-14)
    info = passes[0].info()
    counts, probs, lse = _stats(logits.detach(), valid)
    ref_aux = load_balancing_loss(counts, probs, valid.sum(), K, kind)
    torch.testing.assert_close(info["aux_loss"], ref_aux.float())
    torch.testing.assert_close(info["z_loss"], z_loss(lse, valid.sum(), kind).float())
    load = expert_counts(logits[0].detach().topk(K, -1).indices, valid, E)
    assert torch.equal(info["expert_load"][0], load.long())
