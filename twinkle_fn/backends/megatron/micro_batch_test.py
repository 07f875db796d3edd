"""Micro-batches from twinkle batches, a loss's fields with them, and per-token values back
(`merge_logps`).

The schedule itself (`forward_backward`) is checked end to end by the megatron backend's parity
tests (`twinkle_fn/backends/megatron/backend_test.py`).
"""

import itertools

import pytest
import torch

from twinkle_fn.backends.megatron.micro_batch import (
    MicroBatch,
    merge_logps,
    micro_batches,
)
from twinkle_fn.data import pack, pad_collate
from twinkle_fn.testing import random_features

FEATS = random_features(5, seed=11)


def test_packed_batches_split_by_sample_and_pad_to_the_sequence_multiple():
    batch = pack(FEATS)
    lengths = [len(f["input_ids"]) for f in FEATS]
    mbs = micro_batches(batch, 2, seq_multiple=4)
    real_labels = []
    for mb, group in zip(mbs, ([0, 1, 2], [3, 4]), strict=True):
        sizes = [lengths[i] for i in group]
        n = sum(sizes)
        cu = mb.packed.cu_seqlens_q.tolist()
        assert list(mb.bounds) == cu  # kept on the host, for readers after the forward
        assert mb.input_ids.shape[1] == -(-n // 4) * 4
        assert cu[: len(group) + 1] == [0, *torch.tensor(sizes).cumsum(0).tolist()]
        assert cu[-1] == mb.input_ids.shape[1]  # the padding is one more sample
        assert (mb.labels[0, n:] == -100).all()
        assert mb.position_ids[0, : sizes[0]].tolist() == list(range(sizes[0]))
        real_labels.append(mb.labels[0, :n])
    assert torch.equal(torch.cat(real_labels), batch["labels"][0])


def test_a_micro_batch_has_host_bounds_exactly_when_it_is_packed():
    packed = micro_batches(pack(FEATS), 1)[0]
    padded = micro_batches(pad_collate(FEATS, pad_token_id=0), 1)[0]
    assert padded.bounds is None and padded.packed is None
    with pytest.raises(ValueError, match=r"bounds .* exactly when it is packed"):
        MicroBatch(packed.input_ids, packed.position_ids, packed.labels, packed.packed)
    with pytest.raises(ValueError, match="exactly when it is packed"):
        MicroBatch(padded.input_ids, padded.position_ids, padded.labels, bounds=(0, 4))


def test_padded_batches_split_by_row_and_pad_columns():
    batch = pad_collate(FEATS, pad_token_id=0)
    mbs = micro_batches(batch, 2, seq_multiple=5)
    assert [mb.input_ids.shape[0] for mb in mbs] == [3, 2]
    width = batch["input_ids"].shape[1]
    assert all(mb.input_ids.shape[1] == -(-width // 5) * 5 for mb in mbs)
    assert torch.equal(torch.cat([mb.labels[:, :width] for mb in mbs]), batch["labels"])
    assert all((mb.labels[:, width:] == -100).all() for mb in mbs)
    assert all(mb.packed is None for mb in mbs)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("cp_rank", [None, 1])
def test_supervised_rows_index_the_labels_in_the_hidden_states_layout(layout, cp_rank):
    """The fused loss flattens the last stage's ``[s, b]`` hidden states: the rows found before
    the forward are the supervised labels' places in that order, on each context-parallel rank."""
    batch = pack(FEATS) if layout == "packed" else pad_collate(FEATS, pad_token_id=0)
    cp = {} if cp_rank is None else {"cp_size": 2, "cp_rank": cp_rank}
    for mb in micro_batches(batch, 2, seq_multiple=4, **cp):
        flat = mb.labels.t().reshape(-1)
        assert mb.supervised_rows.dtype == torch.int64
        assert mb.supervised_rows.tolist() == (flat != -100).nonzero().squeeze(1).tolist()
        assert 0 < mb.supervised_rows.numel() < flat.numel()


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize(("n", "multiple"), [(1, 1), (2, 3), (3, 4)])
def test_merge_logps_puts_micro_batch_values_back_into_the_batch_layout(layout, n, multiple):
    """Per-token values of the micro-batches (their labels here) come back in the batch's own
    layout, the padding `micro_batches` added dropped."""
    batch = pack(FEATS) if layout == "packed" else pad_collate(FEATS, pad_token_id=0)
    mbs = micro_batches(batch, n, seq_multiple=multiple)
    merged = merge_logps(batch, mbs, [mb.labels.float() for mb in mbs])
    assert torch.equal(merged, batch["labels"].float())


def test_context_parallel_ranks_get_their_zigzag_chunks_of_padded_rows():
    batch = pad_collate(FEATS, pad_token_id=0)
    width = batch["input_ids"].shape[1]
    # cp=2 under sequence parallelism over tp=4: 4 chunks, each rank's part a multiple of 4.
    whole = micro_batches(batch, 1, seq_multiple=4, cp_size=2, cp_rank=0)[0]
    other = micro_batches(batch, 1, seq_multiple=4, cp_size=2, cp_rank=1)[0]
    padded = -(-width // 8) * 8
    chunk = padded // 4
    assert whole.input_ids.shape == (len(FEATS), padded // 2)
    for field in ("input_ids", "labels", "position_ids"):
        a, b = getattr(whole, field), getattr(other, field)
        rebuilt = torch.cat([a[:, :chunk], b, a[:, chunk:]], dim=1)
        full = micro_batches(batch, 1, seq_multiple=8)[0]
        assert torch.equal(rebuilt, getattr(full, field)), field


def test_context_parallel_ranks_get_each_packed_samples_chunks():
    batch = pack(FEATS)
    lengths = [len(f["input_ids"]) for f in FEATS]
    ranks = [micro_batches(batch, 1, seq_multiple=3, cp_size=2, cp_rank=r)[0] for r in (0, 1)]
    cu = ranks[0].packed.cu_seqlens_q.tolist()
    padded = [-(-n // 4) * 4 for n in lengths]  # every sample cut into 4 equal chunks
    assert cu[: len(FEATS) + 1] == [0, *torch.tensor(padded).cumsum(0).tolist()]
    assert ranks[1].packed.cu_seqlens_q.tolist() == cu
    assert cu[-1] % 12 == 0 and ranks[0].labels.shape == (1, cu[-1] // 2)  # 2 x lcm(4, 2 * 3)
    real = []
    for i, (a, b) in enumerate(itertools.pairwise(cu)):
        c = (b - a) // 4
        local = [(a // 2, c), (a // 2 + c, c)]  # offsets of this sample's 2 chunks on a rank
        pieces = [ranks[r].labels[0, s : s + n] for r in (0, 1) for s, n in local]
        sample = torch.cat([pieces[0], pieces[2], pieces[3], pieces[1]])  # chunks 0, 1, 2, 3
        positions = [ranks[r].position_ids[0, s : s + n] for r in (0, 1) for s, n in local]
        assert torch.cat([positions[0], positions[2], positions[3], positions[1]]).tolist() == (
            list(range(b - a))
        )
        if i < len(FEATS):
            real.append(sample[: lengths[i]])
            assert (sample[lengths[i] :] == -100).all()
    assert torch.equal(torch.cat(real), batch["labels"][0])


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda b: b.update(attention_mask=b["attention_mask"].flip(1)), "left padding"),
        (lambda b: b.update(position_ids=b["position_ids"] + 1), "position_ids"),
        (lambda b: b.pop("labels"), "no 'labels'"),
        (lambda b: b.update(labels=b["labels"][:, 1:]), "differ in shape"),
    ],
)
def test_padded_batches_that_megatron_cannot_take_are_named(change, match):
    batch = pad_collate(FEATS, pad_token_id=0)
    change(batch)
    with pytest.raises(ValueError, match=match):
        micro_batches(batch, 1)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda b: b.update(cu_seqlens=b["cu_seqlens"].flip(0)), "rise from 0"),
        (lambda b: b.update(position_ids=b["position_ids"] * 0), "restart"),
        (lambda b: b.update(input_ids=b["input_ids"].expand(2, -1)), "one row"),
    ],
)
def test_packed_batches_that_megatron_cannot_take_are_named(change, match):
    batch = pack(FEATS)
    change(batch)
    if "one row" in match:
        batch["labels"] = batch["labels"].expand(2, -1)
    with pytest.raises(ValueError, match=match):
        micro_batches(batch, 1)


def test_more_micro_batches_than_samples_is_refused():
    with pytest.raises(ValueError, match="cannot split 5"):
        micro_batches(pack(FEATS), 6)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize(("n", "multiple", "cp"), [(1, 1, 1), (2, 3, 1), (2, 4, 2)])
def test_a_losss_fields_travel_with_their_tokens(layout, n, multiple, cp):
    """A float copy of the input ids as a field: every micro-batch, padding and context-parallel
    chunk included, holds it where its input ids are (the padding token is 0, as the fields'
    padding), and `merge_logps` puts it back into the batch's layout."""
    batch = pack(FEATS) if layout == "packed" else pad_collate(FEATS, pad_token_id=0)
    batch["ids_copy"] = batch["input_ids"].double()
    ranks = [
        micro_batches(batch, n, seq_multiple=multiple, cp_size=cp, cp_rank=r, fields=["ids_copy"])
        for r in range(cp)
    ]
    for mbs in ranks:
        for mb in mbs:
            assert mb.fields.keys() == {"ids_copy"} and mb.fields["ids_copy"].dtype == torch.float64
            assert torch.equal(mb.fields["ids_copy"], mb.input_ids.double())
    if cp == 1:
        values = [mb.fields["ids_copy"] for mb in ranks[0]]
        assert torch.equal(merge_logps(batch, ranks[0], values), batch["ids_copy"])
    assert micro_batches(batch, 1)[0].fields == {}  # the default loss reads none


def test_a_field_not_shaped_like_the_labels_is_refused():
    batch = pad_collate(FEATS, pad_token_id=0)
    batch["advantages"] = batch["labels"][:, 1:].float()
    with pytest.raises(ValueError, match=r"batch\['advantages'\] .* differ in shape"):
        micro_batches(batch, 1, fields=["advantages"])
    with pytest.raises(ValueError, match="no 'rewards'"):
        micro_batches(batch, 1, fields=["rewards"])
