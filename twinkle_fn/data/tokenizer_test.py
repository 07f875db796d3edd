import string

import pytest
from transformers import AutoTokenizer

from twinkle_fn.data.tokenizer import CHARS, SPECIAL_TOKENS, char_tokenizer

ASCII_TEXT = "".join(c for c in string.printable if c.isprintable()) + "\n\tline two\n"
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
]


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def test_vocab_is_small_with_specials_first(tok):
    assert len(tok) == len(SPECIAL_TOKENS) + len(CHARS) == 102 < 128
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert (tok.pad_token, tok.eos_token, tok.unk_token) == ("<|pad|>", "<|endoftext|>", "<|unk|>")
    assert set(tok.all_special_tokens) == set(SPECIAL_TOKENS)


def test_ascii_round_trip_one_token_per_character(tok):
    ids = tok(ASCII_TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(ASCII_TEXT)
    assert [tok.decode([i]) for i in ids] == list(ASCII_TEXT)
    assert tok.decode(ids) == ASCII_TEXT
    assert tok.decode(tok("  a  .  b ,c")["input_ids"]) == "  a  .  b ,c"


def test_unknown_characters_map_to_unk(tok):
    # byte-level: "é" is two UTF-8 bytes, "\r" one; each unknown byte is one <|unk|>
    ids = tok("aé\rb", add_special_tokens=False)["input_ids"]
    assert ids == [tok.convert_tokens_to_ids("a"), 4, 4, 4, tok.convert_tokens_to_ids("b")]


def test_special_tokens_are_single_tokens_in_text(tok):
    ids = tok("<|im_start|>hi<|im_end|><|endoftext|>", add_special_tokens=False)["input_ids"]
    assert ids == [2, tok.convert_tokens_to_ids("h"), tok.convert_tokens_to_ids("i"), 3, 1]


def test_chat_template_is_chatml(tok):
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
    )
    assert tok.apply_chat_template(CONVERSATION, tokenize=False) == expected
    prompt = tok.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == expected[: expected.index("4<|im_end|>")]


def test_save_and_reload_offline_is_identical(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert len(loaded) == len(tok)
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.unk_token_id) == (0, 1, 4)
    assert loaded.get_vocab() == tok.get_vocab()
    ids = loaded(ASCII_TEXT, add_special_tokens=False)["input_ids"]
    assert ids == tok(ASCII_TEXT, add_special_tokens=False)["input_ids"]
    assert loaded.decode(ids) == ASCII_TEXT
    assert loaded.apply_chat_template(CONVERSATION, tokenize=False) == tok.apply_chat_template(
        CONVERSATION, tokenize=False
    )


def test_reloads_identically_next_to_a_qwen2_config(tmp_path):
    """transformers picks the tokenizer class from config.json's model type (Qwen2Tokenizer);
    the checkpoint `twinkle train` writes must still tokenize exactly as in training."""
    from transformers import AutoTokenizer, Qwen2Config

    tok = char_tokenizer()
    tok.save_pretrained(tmp_path)
    Qwen2Config(vocab_size=len(tok)).save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    text = "What is 12 + 34?\n<|im_start|>assistant\n46<|im_end|>\n\tok"
    assert again(text).input_ids == tok(text).input_ids
    assert again.decode(again(text).input_ids) == text
