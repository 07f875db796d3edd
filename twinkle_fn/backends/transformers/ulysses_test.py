"""Ulysses sequence parallelism: the batch split on one process, parity of 2 gloo ranks with one
process (padded and packed), and the refusal of heads the group does not divide."""

import pytest
import torch

import twinkle_fn as tf
from twinkle_fn.backends.transformers.ulysses import KEY_MASK, check_ulysses, local_batch
from twinkle_fn.data import pack, pad_collate
from twinkle_fn.testing import random_features, tiny_config
from twinkle_fn.testing_dist import spawn

STEPS = 2


def test_local_batch_pads_to_the_group_and_keeps_global_positions_and_boundaries():
    packed = {
        "input_ids": torch.arange(1, 6)[None],  # [1, 5]: samples of 3 and 2 tokens
        "labels": torch.tensor([[2, 3, -100, 5, -100]]),
        "position_ids": torch.tensor([[0, 1, 2, 0, 1]]),
        "cu_seqlens": torch.tensor([0, 3, 5]),
        "max_seqlen": 3,
    }
    second = local_batch(packed, 2, 1)
    assert second["input_ids"].tolist() == [[4, 5, 0]]
    assert second["labels"].tolist() == [[5, -100, -100]]
    assert second["position_ids"].tolist() == [[0, 1, 2]]  # the padding continues the last
    assert second["cu_seqlens"].tolist() == [0, 3, 5, 6]  # the padding is a sample of its own
    padded = {
        "input_ids": torch.tensor([[1, 2, 3], [4, 5, 0]]),
        "labels": torch.tensor([[2, 3, -100], [5, -100, -100]]),
        "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
    }
    first = local_batch(padded, 2, 0)
    assert first["position_ids"].tolist() == [[0, 1], [0, 1]]
    assert first[KEY_MASK].tolist() == [[True] * 3 + [False], [True, True, False, False]]
    assert "attention_mask" not in first


def _batches() -> list[dict]:
    """Two padded and two packed batches of odd total length (the split pads them)."""
    out = []
    for i in range(STEPS):
        feats = random_features(4, seed=200 + i, min_len=5, max_len=13)
        out.append(pad_collate(feats, pad_token_id=0))
    for i in range(STEPS):
        out.append(pack(random_features(4, seed=300 + i, min_len=5, max_len=13)))
    return out


def _train(mesh_sizes: dict) -> dict[str, tuple[list[float], dict[str, torch.Tensor]]]:
    """For padded batches, packed ones, and both as two micro-batches of a step: losses of STEPS
    AdamW steps from the same weights (every rank gets the whole batch: ulysses ranks share a
    data shard) and the final parameters."""
    batches = _batches()
    out = {}
    for layout, part in (("padded", batches[:STEPS]), ("packed", batches[STEPS:])):
        out[layout] = _steps(mesh_sizes, [[b] for b in part])
    # two accumulated micro-batches a step: each micro-batch's gradients are summed over the
    # group before they join the accumulated ones
    out["accumulated"] = _steps(mesh_sizes, [batches[:STEPS], batches[STEPS:]])
    # the second rank's slice has no supervised token: it still runs every all-to-all
    first_half = dict(batches[0], labels=batches[0]["labels"].clone())
    first_half["labels"][:, (first_half["labels"].shape[1] + 1) // 2 :] = -100
    out["half_supervised"] = _steps(mesh_sizes, [[first_half]])
    return out


def _steps(mesh_sizes: dict, steps: list[list[dict]]) -> tuple[list[float], dict]:
    """Losses of one AdamW step per entry of `steps` (its micro-batches accumulated), and the
    final parameters."""
    model = tf.models.from_hf_config(tiny_config("qwen2"), seed=0, device="cpu")
    model.module.to(torch.float64)
    state = tf.init(model, tf.optim.adamw(1e-2), tf.Mesh(**mesh_sizes))
    losses = []
    for micro_batches in steps:
        grads = None
        for batch in micro_batches:
            grads, _ = tf.fwd_bwd(state, batch, accum=grads)
        state, info = tf.step(state, grads)
        losses.append(float(info["loss"]))
    return losses, tf.unshard(state)


def _train_on_rank(mesh_sizes: dict) -> dict:
    torch.set_num_threads(1)  # two ranks on a shared CPU: intra-op threads only contend
    return _train(mesh_sizes)


@pytest.fixture(scope="module")
def runs():
    """One process and 2 ulysses ranks, from one spawn for the whole module."""
    return _train({}), spawn(_train_on_rank, 2, {"ulysses": 2})


@pytest.mark.parametrize("layout", ["padded", "packed", "accumulated", "half_supervised"])
def test_ulysses2_matches_one_process(runs, layout):
    """float64, so that a wrong gradient cannot hide in rounding: the ranks sum each row's token
    losses in two parts, so losses agree to ~1e-15 (asserted 1e-12) and parameters after 2
    AdamW steps to 1e-9 (Adam divides tiny gradients by their own scale: the key biases'
    gradients are exactly 0 up to rounding; in float32 that noise alone moves them ~1e-5)."""
    reference, ranks = runs
    ref_losses, ref_params = reference[layout]
    for result in ranks:
        losses, params = result[layout]
        assert losses == pytest.approx(ref_losses, rel=1e-12)
        assert params.keys() == ref_params.keys()
        for n, p in params.items():
            torch.testing.assert_close(p, ref_params[n], rtol=1e-9, atol=1e-11, msg=n)
    # the steps moved the parameters, so the agreement above is not that of untouched weights
    start = tf.models.from_hf_config(tiny_config("qwen2"), seed=0, device="cpu").module
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(start.get_parameter(name).double(), ref_params[name])


def test_heads_the_group_does_not_divide_are_refused_before_any_compute():
    model = tf.models.from_hf_config(
        tiny_config("qwen2", num_key_value_heads=1), seed=0, device="cpu"
    )
    with pytest.raises(ValueError, match="ulysses=2 does not divide the 1 key/value heads"):
        tf.init(model, tf.optim.adamw(1e-2), tf.Mesh(ulysses=2))


def test_linear_attention_layers_are_refused():
    """A Gated DeltaNet layer would run its recurrence on each rank's slice of the sequence."""
    with pytest.raises(ValueError, match="ulysses=2 splits the sequence, but this model's linear"):
        check_ulysses(tiny_config("qwen3_5_text"), 2, 1, False)
    full_attention = tiny_config("qwen3")
    full_attention._attn_implementation = "sdpa"
    check_ulysses(full_attention, 2, 1, False)
