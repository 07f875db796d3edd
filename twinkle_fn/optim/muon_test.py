import math

import pytest
import torch

from twinkle_fn.optim import apply_updates, chain, clip_by_global_norm
from twinkle_fn.optim.muon import MuonState, adjusted_lr, muon, newton_schulz

STEPS = 4


def _params(dtype):
    gen = torch.Generator().manual_seed(0)
    return {
        "wide.weight": torch.randn(3, 7, generator=gen, dtype=dtype),
        "tall.weight": torch.randn(9, 4, generator=gen, dtype=dtype),
        "final_norm.weight": torch.randn(1, 5, generator=gen, dtype=dtype),  # 2-D, but no decay
    }


def _run_both(params, torch_groups, tx, lr_per_step=None, **torch_kwargs):
    refs = {k: torch.nn.Parameter(p.clone()) for k, p in params.items()}
    opt = torch.optim.Muon(
        [{**g, "params": [refs[k] for k in g["params"]]} for g in torch_groups], **torch_kwargs
    )
    ours = {k: p.clone() for k, p in params.items()}
    state = tx.init(ours)
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        grads = {k: torch.randn(p.shape, generator=gen, dtype=p.dtype) for k, p in params.items()}
        for k in params:
            refs[k].grad = grads[k].clone()
        if lr_per_step:
            for g in opt.param_groups:
                g["lr"] = lr_per_step(step)
        opt.step()
        updates, state = tx.update(grads, state, ours)
        apply_updates(ours, updates)
    return ours, {k: r.detach() for k, r in refs.items()}, state


# The orthogonalised update is computed in bfloat16 by both (the same ops on the same
# inputs: bit-equal); the remaining difference is the order of the final adds (torch scales
# p by (1 - lr*wd), then adds; we add one combined update): a few ulps of the weight.
TOL = {torch.float32: 2e-6, torch.float64: 1e-12}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_matches_torch_muon_step_for_step(dtype, nesterov, adjust_lr_fn):
    params = _params(dtype)
    kwargs = dict(lr=0.02, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    tx = muon(weight_decay=0.1, **kwargs)
    groups = [
        {"params": ["wide.weight", "tall.weight"], "weight_decay": 0.1},
        {"params": ["final_norm.weight"], "weight_decay": 0.0},
    ]
    ours, ref, state = _run_both(params, groups, tx, **kwargs)
    for k in params:
        torch.testing.assert_close(ours[k], ref[k], rtol=TOL[dtype], atol=TOL[dtype])
        assert not torch.equal(ours[k], params[k])
    assert isinstance(state, MuonState) and int(state.count) == STEPS


def test_schedule_and_chain_with_clip_match_torch():
    params = _params(torch.float64)

    def schedule(count: int) -> float:
        return 0.05 / (1 + count)

    tx = chain(clip_by_global_norm(1e6), muon(schedule, mask=None))
    groups = [{"params": list(params), "weight_decay": 0.0}]
    ours, ref, state = _run_both(params, groups, tx, lr_per_step=schedule, lr=schedule(0))
    for k in params:
        torch.testing.assert_close(ours[k], ref[k], rtol=1e-12, atol=1e-12)
    assert math.isclose(float(state[1].lr), schedule(STEPS - 1))


def test_newton_schulz_orthogonalises():
    gen = torch.Generator().manual_seed(2)
    for shape in [(4, 16), (16, 4)]:
        m = torch.randn(*shape, generator=gen, dtype=torch.float64)
        o = newton_schulz(m).double()
        small = min(shape)
        gram = o @ o.T if shape[0] < shape[1] else o.T @ o  # [small, small]
        # singular values land in roughly [0.5, 1.5] (torch's coefficients), not exactly 1
        s = torch.linalg.eigvalsh(gram).sqrt()
        assert s.shape == (small,) and bool(((s > 0.3) & (s < 1.6)).all()), s
    assert adjusted_lr(1.0, None, (8, 2)) == 2.0
    assert adjusted_lr(1.0, "match_rms_adamw", (4, 16)) == pytest.approx(0.8)


def test_refuses_non_matrices_and_bad_values():
    with pytest.raises(ValueError, match="parameter 'b' has shape \\(3,\\)"):
        muon(0.1).init({"w": torch.ones(2, 2), "b": torch.ones(3)})
    with pytest.raises(ValueError, match="adjust_lr_fn must be one of"):
        muon(0.1, adjust_lr_fn="rms")
    with pytest.raises(ValueError, match="momentum must be finite and >= 0"):
        muon(0.1, momentum=-1.0)
    with pytest.raises(ValueError, match="ns_steps must be an int"):
        muon(0.1, ns_steps=0)
