"""Data: encoding chats and text into features, collation, packing and micro-batching.

A feature is ``{"input_ids": list[int], "labels": list[int]}`` with labels already shifted
(``labels[t]`` is the target of position ``t``; -100 is ignored), plus any numbers a loss reads
(per token or per sample, see `feature_fields`). `pad_collate` and `pack` turn features into
padded or padding-free batches of tensors.
"""

from twinkle_fn.data.arithmetic import arithmetic_dataset, train_heldout_split
from twinkle_fn.data.chat import encode_messages, encode_text, validate_messages
from twinkle_fn.data.collate import (
    IGNORE_INDEX,
    Feature,
    check_features,
    check_supervised,
    feature_fields,
    num_supervised_tokens,
    pad_collate,
)
from twinkle_fn.data.jsonl import encode_rows, load_jsonl, read_text
from twinkle_fn.data.microbatch import split_batch, split_features
from twinkle_fn.data.packing import pack, pack_greedy, packed_attention_mask
from twinkle_fn.data.tokenizer import char_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "Feature",
    "arithmetic_dataset",
    "char_tokenizer",
    "check_features",
    "check_supervised",
    "encode_messages",
    "encode_rows",
    "encode_text",
    "feature_fields",
    "load_jsonl",
    "num_supervised_tokens",
    "pack",
    "pack_greedy",
    "packed_attention_mask",
    "pad_collate",
    "read_text",
    "split_batch",
    "split_features",
    "train_heldout_split",
    "validate_messages",
]
