"""Upstream's `MegatronModel` usage example on its own mesh, dp 2 x tp 2 x pp 2: 8 gloo ranks.

The docs' example (`cookbook/megatron_tp.py`, a LoRA adapter) on 8 real processes must give,
step for step, the losses of the same script on one process: the mesh only changes the order of
sums. The adapter it then saves (a peft directory) must load into the HF model with peft and give
the loss the 8 ranks' `forward_only` computes on a fixed batch. float32 throughout (megatron's
distributed optimizer has no float64 path): relative 1e-5 on losses (observed 1e-7 on the
training losses, 6e-8 between the ranks' and peft's losses).
Marked slow: 8 processes each import megatron-core on a 2-core machine (about a minute).
"""

import runpy
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from twinkle_fn.testing import random_features
from twinkle_fn.testing_dist import spawn

COOKBOOK = Path(__file__).resolve().parent.parent / "cookbook"
EXAMPLE = dict(num_samples=32, batch_size=8, gradient_accumulation_steps=2, lr=1e-3)
MESH = dict(dp_size=2, tp_size=2, pp_size=2)
EVAL_BATCH = random_features(8, seed=5)  # 4 rows per data rank: 2 pipeline micro-batches
RTOL = 1e-5


def _example(model_dir, sizes, save_dir=None):
    """The example's losses; with `save_dir`, also the saved adapter's path and this rank's
    data rank and `forward_only` loss and token count on its slice of EVAL_BATCH."""
    torch.set_num_threads(1)  # 8 ranks on 2 cores: intra-op threads only contend
    run = runpy.run_path(str(COOKBOOK / "megatron_tp.py"))["run"]
    if save_dir is None:
        return run(model_dir, **sizes, **EXAMPLE)
    losses, model = run(model_dir, **sizes, **EXAMPLE, return_model=True)
    path = model.save("adapter", output_dir=save_dir)
    mesh = model.device_mesh
    out = model.forward_only(inputs=EVAL_BATCH[mesh.get_slice(len(EVAL_BATCH))])
    return losses, path, mesh.data_rank, out["loss"], out["num_tokens"]


def _token_mean_loss(model, feats):
    """The token-mean cross entropy of `feats` (already-shifted labels), row by row."""
    total, count = 0.0, 0
    with torch.no_grad():
        for f in feats:
            logits = model(input_ids=torch.tensor([f["input_ids"]])).logits[0]  # [seq, vocab]
            labels = torch.tensor(f["labels"])
            keep = labels != -100
            logps = logits.log_softmax(-1)[keep].gather(-1, labels[keep, None])
            total, count = total - float(logps.sum()), count + int(keep.sum())
    return total / count, count


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    make = runpy.run_path(str(COOKBOOK / "make_tiny_model.py"))["make_tiny_model"]
    return str(make(tmp_path_factory.mktemp("tiny") / "model", hidden_size=32))


@pytest.fixture(scope="module")
def eight_ranks(model_dir, tmp_path_factory):
    save_dir = str(tmp_path_factory.mktemp("saved"))
    return spawn(_example, 8, model_dir, MESH, save_dir, timeout_s=600)


@pytest.mark.slow
def test_seed_mesh_dp2_tp2_pp2_matches_one_process(model_dir, eight_ranks):
    (one,) = spawn(_example, 1, model_dir, {}, timeout_s=300)
    assert len(one) == EXAMPLE["num_samples"] // EXAMPLE["batch_size"] // 2
    for losses, *_ in eight_ranks:  # every rank reports the globally reduced loss
        assert losses == pytest.approx(one, rel=RTOL)
    assert one[-1] < one[0]


@pytest.mark.slow
def test_adapter_saved_on_the_mesh_gives_its_loss_in_peft(model_dir, eight_ranks):
    """Every rank of a data rank (its tp and pp peers) reports the loss of that data rank's
    rows; the HF model with the saved adapter in peft gives the same, to fp32 rounding."""
    paths = {path for _, path, *_ in eight_ranks}
    assert len(paths) == 1
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, paths.pop()).eval()
    assert sorted(data_rank for _, _, data_rank, *_ in eight_ranks) == [0] * 4 + [1] * 4
    for _, _, data_rank, loss, num_tokens in eight_ranks:
        rows = EVAL_BATCH[4 * data_rank : 4 * data_rank + 4]
        expected, count = _token_mean_loss(peft_model, rows)
        assert num_tokens == count
        assert loss == pytest.approx(expected, rel=RTOL)
        with peft_model.disable_adapter():
            base, _ = _token_mean_loss(peft_model, rows)
        # the adapter moves the loss well beyond the tolerance (3e-4 to 7e-4): the check sees it
        assert abs(base - expected) > 10 * RTOL * expected
