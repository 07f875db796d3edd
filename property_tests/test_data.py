"""Property tests for twinkle_fn.data: collation, packing, splitting and chat encoding."""

import itertools
import string

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from twinkle_fn.data.chat import encode_messages
from twinkle_fn.data.collate import IGNORE_INDEX, pad_collate
from twinkle_fn.data.microbatch import split_batch, split_features
from twinkle_fn.data.packing import pack, pack_greedy, packed_attention_mask
from twinkle_fn.data.tokenizer import char_tokenizer

SETTINGS = settings(max_examples=60, deadline=None)
TOKENIZER = char_tokenizer()

token = st.integers(min_value=0, max_value=1000)
label = st.one_of(st.just(IGNORE_INDEX), token)


@st.composite
def feature(draw, max_len=12):
    n = draw(st.integers(min_value=1, max_value=max_len))
    ids = draw(st.lists(token, min_size=n, max_size=n))
    labels = draw(st.lists(label, min_size=n, max_size=n))
    return {"input_ids": ids, "labels": labels}


features = st.lists(feature(), min_size=1, max_size=8)


@SETTINGS
@given(features, st.integers(0, 5), st.one_of(st.none(), st.integers(1, 8)))
def test_pad_collate_then_unpad_gives_back_the_features(feats, pad_id, multiple):
    batch = pad_collate(feats, pad_token_id=pad_id, pad_to_multiple_of=multiple)
    longest = max(len(f["input_ids"]) for f in feats)
    seq = batch["input_ids"].shape[1]
    if multiple is None:
        assert seq == longest
    else:
        assert seq % multiple == 0 and longest <= seq < longest + multiple
    for row, f in enumerate(feats):
        n = len(f["input_ids"])
        real = batch["attention_mask"][row].bool()
        assert real.tolist() == [True] * n + [False] * (seq - n)
        assert batch["input_ids"][row][real].tolist() == f["input_ids"]
        assert batch["labels"][row][real].tolist() == f["labels"]
        assert batch["position_ids"][row][real].tolist() == list(range(n))
        assert set(batch["input_ids"][row][~real].tolist()) <= {pad_id}
        assert set(batch["labels"][row][~real].tolist()) <= {IGNORE_INDEX}


@SETTINGS
@given(features)
def test_pack_unpack_round_trip_and_matches_padded(feats):
    packed = pack(feats)
    bounds = packed["cu_seqlens"].tolist()
    assert bounds[0] == 0 and len(bounds) == len(feats) + 1
    assert bounds[-1] == packed["input_ids"].shape[1]
    assert packed["max_seqlen"] == max(b - a for a, b in itertools.pairwise(bounds))
    unpacked = [
        {
            "input_ids": packed["input_ids"][0, a:b].tolist(),
            "labels": packed["labels"][0, a:b].tolist(),
        }
        for a, b in itertools.pairwise(bounds)
    ]
    assert unpacked == [dict(f) for f in feats]
    for a, b in itertools.pairwise(bounds):
        assert packed["position_ids"][0, a:b].tolist() == list(range(b - a))
    padded = pad_collate(feats, pad_token_id=0)
    real = padded["attention_mask"].bool()
    for key in ("input_ids", "labels", "position_ids"):
        assert torch.equal(packed[key][0], padded[key][real])


@SETTINGS
@given(st.lists(st.integers(0, 6), min_size=1, max_size=6))
def test_packed_attention_mask_equals_naive_reference(lengths):
    # Zero-length samples are allowed in cu_seqlens and must not change the mask.
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    total = bounds[-1]
    mask = packed_attention_mask(torch.tensor(bounds, dtype=torch.int32), total)
    assert mask.shape == (1, 1, total, total)

    def owner(i):
        return next(s for s in range(len(lengths)) if bounds[s] <= i < bounds[s + 1])

    for q in range(total):
        for k in range(total):
            assert bool(mask[0, 0, q, k]) == (owner(q) == owner(k) and k <= q)


@SETTINGS
@given(st.lists(st.integers(0, 99), min_size=1, max_size=30), st.data())
def test_split_features_is_contiguous_balanced_and_covers(items, data):
    parts = data.draw(st.integers(1, len(items)))
    chunks = split_features(items, parts)
    assert len(chunks) == parts
    assert [x for chunk in chunks for x in chunk] == items
    sizes = [len(c) for c in chunks]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


@SETTINGS
@given(features, st.data())
def test_split_batch_matches_collating_each_split(feats, data):
    parts = data.draw(st.integers(1, len(feats)))
    batch = pad_collate(feats, pad_token_id=0)
    micro = split_batch(batch, parts)
    rows = split_features(list(range(len(feats))), parts)
    for part, idx in zip(micro, rows, strict=True):
        for key in batch:
            assert torch.equal(part[key], batch[key][idx])


value = st.floats(-1e3, 1e3, width=32)


@st.composite
def features_with_fields(draw):
    """Features with a per-token ``old_logps`` and a per-sample ``reward``."""
    feats = draw(features)
    return [
        {
            **f,
            "old_logps": draw(
                st.lists(value, min_size=len(f["labels"]), max_size=len(f["labels"]))
            ),
            "reward": draw(value),
        }
        for f in feats
    ]


def _unpadded_fields(batch, row, n):
    return {key: batch[key][row, :n].tolist() for key in ("old_logps", "reward")}


@SETTINGS
@given(features_with_fields(), st.data())
def test_fields_stay_with_their_tokens_through_collation_packing_and_splitting(feats, data):
    want = [
        {"old_logps": f["old_logps"], "reward": [f["reward"]] * len(f["labels"])} for f in feats
    ]
    padded = pad_collate(feats, pad_token_id=0)
    packed = pack(feats)
    bounds = packed["cu_seqlens"].tolist()
    for row, f in enumerate(feats):
        n = len(f["labels"])
        assert _unpadded_fields(padded, row, n) == want[row]
        assert all(padded[key][row, n:].eq(0).all() for key in ("old_logps", "reward"))
        a, b = bounds[row], bounds[row + 1]
        assert {key: packed[key][0, a:b].tolist() for key in want[row]} == want[row]
    parts = data.draw(st.integers(1, len(feats)))
    rows = split_features(list(range(len(feats))), parts)
    for part, idx in zip(split_batch(padded, parts), rows, strict=True):
        for i, row in enumerate(idx):
            assert _unpadded_fields(part, i, len(feats[row]["labels"])) == want[row]
    for group, idx in zip(split_features(feats, parts), rows, strict=True):
        again = pack(group)
        assert torch.equal(
            again["old_logps"][0], packed["old_logps"][0, bounds[idx[0]] : bounds[idx[-1] + 1]]
        )


@SETTINGS
@given(st.lists(st.integers(1, 10), min_size=1, max_size=15), st.integers(10, 25))
def test_pack_greedy_partitions_within_capacity(lengths, max_tokens):
    feats = [{"input_ids": [1] * n, "labels": [1] * n} for n in lengths]
    packs = pack_greedy(feats, max_tokens)
    assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
    assert all(p == sorted(p) and sum(lengths[i] for i in p) <= max_tokens for p in packs)
    # First fit never opens a pack its item would fit in an earlier one, and loads only grow,
    # so any two packs together exceed the capacity.
    loads = [sum(lengths[i] for i in p) for p in packs]
    assert all(a + b > max_tokens for i, a in enumerate(loads) for b in loads[i + 1 :])
    assert pack_greedy(feats, max_tokens) == packs


content = st.text(alphabet=string.ascii_letters + string.digits + " .,?!\n", max_size=12)


@st.composite
def conversation(draw):
    messages = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(content)})
    for _ in range(draw(st.integers(1, 3))):
        messages.append({"role": "user", "content": draw(content)})
        messages.append({"role": "assistant", "content": draw(content)})
    return messages


@settings(max_examples=40, deadline=None)
@given(conversation())
def test_chat_label_spans_are_exactly_the_assistant_turns(messages):
    feature = encode_messages(TOKENIZER, messages)
    ids, labels = feature["input_ids"], feature["labels"]
    assert TOKENIZER.decode(ids) == TOKENIZER.apply_chat_template(messages, tokenize=False)
    # Unshift: position t + 1 is supervised iff labels[t] is set, and then holds that token.
    supervised = [False] + [label != IGNORE_INDEX for label in labels[:-1]]
    assert labels[-1] == IGNORE_INDEX
    for t, on in enumerate(supervised):
        assert not on or labels[t - 1] == ids[t]
    spans, start = [], None
    for t, on in enumerate([*supervised, False]):
        if on and start is None:
            start = t
        elif not on and start is not None:
            spans.append(TOKENIZER.decode(ids[start:t]))
            start = None
    assert spans == [m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant"]
