"""``calculate_metric(is_training=False)`` after `forward_only` on 2 real gloo ranks: the
evaluation loss is the token-weighted mean over the data ranks and every rank reports the same
numbers (upstream's ``LossMetric`` gathers over the data-parallel group); tp peers of one data
rank count once. One spawn runs both model classes; the parent compares. ``add_metric`` (a
`twinkle.metric.Metric` of one's own) sees every forward of its kind and gathers over the data
ranks like the built-in numbers."""

import math

import pytest
import torch

from twinkle import DeviceMesh
from twinkle.metric import Metric
from twinkle.model import MegatronModel, TransformersModel
from twinkle_fn.testing import random_features, tiny_config
from twinkle_fn.testing_dist import spawn

GLOBAL_BATCH, EVAL_BATCHES = 8, 2


class TokenCount(Metric):
    """The supervised tokens of the inputs it saw (times `scale`) and the token-mean of the
    calls' losses, gathered over the data ranks; the group's step at each call."""

    def __init__(self, device_mesh=None, process_group=None, scale=1):
        super().__init__(device_mesh, process_group)
        self.scale = scale
        self.reset()

    def accumulate(self, inputs, outputs, **info):
        self.tokens += int((inputs["labels"] != -100).sum())
        self.loss_sum += outputs["loss"] * outputs["num_tokens"]
        self.steps.append(info["step"])

    def calculate(self):
        parts = self.gather_results([(self.tokens, self.loss_sum)])
        tokens = sum(t for t, _ in parts)
        out = {
            "seen_tokens": self.scale * tokens,
            "seen_loss": sum(s for _, s in parts) / max(tokens, 1),
            "steps": self.steps,
        }
        self.reset()
        return out

    def reset(self):
        self.tokens, self.loss_sum, self.steps = 0, 0.0, []


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
    transformers.add_metric(TokenCount, is_training=False)
    megatron = MegatronModel(config=tiny_config(), device_mesh=dp2, seed=0)
    megatron.add_metric(TokenCount, is_training=False)
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


@pytest.mark.parametrize("run", ["transformers", "megatron_dp2"])
def test_an_added_metric_gathers_over_the_data_ranks(ranks, run):
    """The metric counts the labels of the batches it saw: every data rank's, as the built-in
    ``num_tokens``; the loss token-weighted as the built-in one."""
    for r in ranks:
        _, metric = r[run]
        assert metric["seen_tokens"] == metric["num_tokens"] > 0
        assert math.isclose(metric["seen_loss"], metric["loss"], rel_tol=1e-6)


def test_add_metric_watches_the_forwards_of_its_kind_and_refuses_what_it_cannot_build():
    model = TransformersModel(config=tiny_config(), seed=0)
    model.add_metric(TokenCount, scale=2)  # is_training=None: one of its own on each kind
    model.add_metric(TokenCount(), is_training=True)
    calls = []
    for i in range(2):
        out = model.forward_backward(inputs=random_features(4, seed=10 + i))
        calls.append(int(out["num_tokens"]))
    model.clip_grad_and_step()
    model.forward_only(inputs=random_features(2, seed=3))  # not a training forward
    metric = model.calculate_metric(is_training=True)
    # merged in the order added: the instance's numbers (scale 1) replace the first's keys
    assert metric["seen_tokens"] == sum(calls) and metric["steps"] == [1, 2]
    assert metric["loss"] > 0 and "grad_norm" in metric  # the built-in numbers stay
    assert model.calculate_metric(is_training=True)["seen_tokens"] == 0  # reset
    eval_metric = model.calculate_metric(is_training=False)
    assert eval_metric["seen_tokens"] == 2 * eval_metric["num_tokens"] > 0  # scale 2
    with pytest.raises(ValueError, match=r"'Accuracy'\): .* reads the full logits"):
        model.add_metric("Accuracy")
    with pytest.raises(TypeError, match="a metric instance and arguments"):
        model.add_metric(TokenCount(), scale=2)
    with pytest.raises(TypeError, match="Metric subclass, instance or name"):
        model.add_metric(dict)
