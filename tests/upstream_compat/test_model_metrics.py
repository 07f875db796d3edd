"""``calculate_metric(is_training=False)`` after `forward_only` on 2 real gloo ranks: the
evaluation loss is the token-weighted mean over the data ranks and every rank reports the same
numbers (upstream's ``LossMetric`` gathers over the data-parallel group); tp peers of one data
rank count once. One spawn runs both model classes; the parent compares."""

import math

import pytest
import torch

from twinkle import DeviceMesh
from twinkle.model import MegatronModel, TransformersModel
from twinkle_fn.testing import random_features, tiny_config
from twinkle_fn.testing_dist import spawn

GLOBAL_BATCH, EVAL_BATCHES = 8, 2


def _evaluate(model, mesh, *, with_loss):
    """Upstream's eval loop over this rank's share of EVAL_BATCHES global batches: the
    per-call (loss, num_tokens) of this rank, and the metric."""
    feats = random_features(GLOBAL_BATCH * EVAL_BATCHES, seed=5)
    calls = []
    for i in range(EVAL_BATCHES):
        batch = feats[i * GLOBAL_BATCH : (i + 1) * GLOBAL_BATCH][mesh.get_slice(GLOBAL_BATCH)]
        out = model.forward_only(inputs=batch)
        if with_loss:
            model.calculate_loss()
        calls.append((float(out["loss"]), int(out["num_tokens"])))
    return calls, model.calculate_metric(is_training=False)


def _data_parallel():
    torch.set_num_threads(1)  # two ranks on a shared CPU: intra-op threads only contend
    dp2 = DeviceMesh.from_sizes(dp_size=2)
    transformers = TransformersModel(config=tiny_config(), device_mesh=dp2, seed=0)
    megatron = MegatronModel(config=tiny_config(), device_mesh=dp2, seed=0)
    return {
        "transformers": _evaluate(transformers, dp2, with_loss=True),
        "megatron_dp2": _evaluate(megatron, dp2, with_loss=False),
    }


def _tensor_parallel():
    # megatron-core holds one mesh per process: a spawn of its own
    torch.set_num_threads(1)
    tp2 = DeviceMesh.from_sizes(tp_size=2)
    megatron = MegatronModel(config=tiny_config(), device_mesh=tp2, seed=0)
    return {"megatron_tp2": _evaluate(megatron, tp2, with_loss=False)}


@pytest.fixture(scope="module")
def ranks():
    dp, tp = spawn(_data_parallel, 2, timeout_s=300), spawn(_tensor_parallel, 2, timeout_s=300)
    return [{**dp[r], **tp[r]} for r in range(2)]


def _token_mean(calls):
    tokens = sum(n for _, n in calls)
    return sum(loss * n for loss, n in calls) / tokens, tokens


@pytest.mark.parametrize("run", ["transformers", "megatron_dp2"])
def test_the_eval_loss_is_token_weighted_over_the_data_ranks(ranks, run):
    (calls0, metric0), (calls1, metric1) = ranks[0][run], ranks[1][run]
    assert metric0 == metric1  # every rank reports the same numbers
    loss, tokens = _token_mean(calls0 + calls1)
    assert metric0["num_tokens"] == tokens
    assert math.isclose(metric0["loss"], loss, rel_tol=1e-6)
    # the ranks saw different rows: a rank's own mean is not the answer
    assert not math.isclose(_token_mean(calls0)[0], loss, rel_tol=1e-6)


def test_tensor_parallel_peers_count_once(ranks):
    (calls0, metric0), (calls1, metric1) = ranks[0]["megatron_tp2"], ranks[1]["megatron_tp2"]
    assert metric0 == metric1
    loss, tokens = _token_mean(calls0)
    assert metric0["num_tokens"] == tokens == _token_mean(calls1)[1]
    assert math.isclose(metric0["loss"], loss, rel_tol=1e-5)


def test_the_sums_reset_after_each_metric():
    # a second calculate_metric without forward_only: nothing counted (one process)
    model = TransformersModel(config=tiny_config(), seed=0)
    model.forward_only(inputs=random_features(2, seed=1))
    assert model.calculate_metric(is_training=False)["num_tokens"] > 0
    assert model.calculate_metric(is_training=False) == {"loss": 0.0, "num_tokens": 0}
