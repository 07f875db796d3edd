"""A character-level tokenizer with a ChatML chat template, built offline.

The `twinkle train` demo trains a tiny random-init model with no network, so it cannot download
a tokenizer. This one is a real ``transformers`` fast tokenizer (it saves and reloads through
``AutoTokenizer``) with a vocabulary small enough for a tiny model: five special tokens, then
printable ASCII, newline and tab, one token each.

It is a byte-level BPE with no merges (GPT-2/Qwen's byte alphabet), not a word-level model:
next to a Qwen ``config.json``, ``AutoTokenizer`` loads it as a ``Qwen2Tokenizer``, which
rebuilds its own byte-level pipeline from the vocabulary, and a byte-level vocabulary is the
only kind that pipeline reads back unchanged.
"""

from __future__ import annotations

import string

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, EOS, IM_START, IM_END, UNK = (
    "<|pad|>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|unk|>",
)
SPECIAL_TOKENS = (PAD, EOS, IM_START, IM_END, UNK)
CHARS = (*(c for c in string.printable if c.isprintable()), "\n", "\t")

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def char_tokenizer(model_max_length: int = 4096) -> PreTrainedTokenizerFast:
    """Build the character-level ChatML tokenizer (102 ids).

    Ids 0-4 are ``<|pad|>``, ``<|endoftext|>`` (EOS), ``<|im_start|>``, ``<|im_end|>`` and
    ``<|unk|>``; then one id per printable ASCII character, newline and tab. Other characters
    are outside the vocabulary (each of their bytes encodes to ``<|unk|>``). Decoding joins characters with no added spaces, so ``decode(encode(s))
    == s`` for strings over that alphabet. The chat template renders each message as
    ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` and the generation prompt as
    ``<|im_start|>assistant\\n``, like Qwen's.
    """
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    symbols = [byte_level.pre_tokenize_str(c)[0][0] for c in CHARS]  # e.g. " " -> "Ġ"
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *symbols))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        extra_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )
