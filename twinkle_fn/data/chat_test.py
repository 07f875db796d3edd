import copy

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from tokenizers.processors import TemplateProcessing
from transformers import PreTrainedTokenizerFast

from twinkle_fn.data.chat import encode_messages, encode_text, validate_messages
from twinkle_fn.data.collate import IGNORE_INDEX, check_supervised
from twinkle_fn.data.tokenizer import char_tokenizer

SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]

# Qwen2.5-style: ChatML with a default system prompt when the conversation has none.
QWEN_LIKE = (
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- set rest = messages[1:] %}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- set rest = messages %}"
    "{%- endif %}"
    "{%- for m in rest %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Llama-3-style: BOS, role headers, a blank line, trimmed content, <|eot_id|> with no newline.
LLAMA_LIKE = (
    "{{- bos_token }}"
    "{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + (m['content'] | trim)"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
# Renders the final message differently, so earlier renderings are not prefixes of later ones.
MARKS_LAST = (
    "{%- for m in messages %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
    "{%- if loop.last %}{{- ' (last)' }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CONVERSATION = [
    {"role": "system", "content": "Answer with a number."},
    {"role": "user", "content": "What is 12 + 34?"},
    {"role": "assistant", "content": "46"},
    {"role": "user", "content": "And the capital of France?"},
    {"role": "assistant", "content": "It is Paris.\n\nA city."},
]


def _trained_backend() -> Tokenizer:
    """A byte-level BPE trained on a tiny corpus, so tokens span several characters."""
    backend = Tokenizer(models.BPE())
    # Isolating newline runs (as Llama 3 and Qwen 2 do) keeps "\n\n" one token at a turn boundary.
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\s*[\r\n]+"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    corpus = [
        "You are a helpful assistant.\n\nWhat is 12 + 34? It is 46.\n",
        "system\nuser\nassistant\n\nThe capital of France is Paris.\n\nA city.\n",
    ] * 4
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    return backend


def _hf(backend: Tokenizer, template: str | None, **kwargs) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|endoftext|>", chat_template=template, **kwargs
    )


@pytest.fixture(scope="module")
def backend():
    return _trained_backend()


@pytest.fixture(scope="module")
def qwen_like(backend):
    return _hf(backend, QWEN_LIKE)


@pytest.fixture(scope="module")
def llama_like(backend):
    return _hf(backend, LLAMA_LIKE, bos_token="<|begin_of_text|>")


def _supervised_spans(feature):
    """Target ids grouped by contiguous runs of supervised positions."""
    spans, previous = [], None
    for t, label in enumerate(feature["labels"]):
        if label == IGNORE_INDEX:
            continue
        if previous != t - 1:
            spans.append([])
        spans[-1].append(label)
        previous = t
    return spans


def _check_shift(feature):
    ids, labels = feature["input_ids"], feature["labels"]
    assert len(ids) == len(labels)
    assert labels[-1] == IGNORE_INDEX
    for t, label in enumerate(labels[:-1]):
        assert label in (IGNORE_INDEX, ids[t + 1])


def test_char_tokenizer_labels_by_hand():
    tok = char_tokenizer()
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    feature = encode_messages(tok, messages)
    text = "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n"
    assert feature["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    # 20 prompt tokens, then "b", <|im_end|>, "\n"; targets sit one position earlier.
    ids = feature["input_ids"]
    assert len(ids) == 23
    assert feature["labels"] == [IGNORE_INDEX] * 19 + ids[20:23] + [IGNORE_INDEX]


@pytest.mark.parametrize(
    ("fixture", "end_of_turn"), [("qwen_like", "<|im_end|>\n"), ("llama_like", "<|eot_id|>")]
)
def test_label_spans_decode_to_assistant_content(request, fixture, end_of_turn):
    tok = request.getfixturevalue(fixture)
    feature = encode_messages(tok, CONVERSATION)
    text = tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert feature["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    _check_shift(feature)
    spans = [tok.decode(span) for span in _supervised_spans(feature)]
    assert spans == [m["content"] + end_of_turn for m in CONVERSATION if m["role"] == "assistant"]


def test_default_system_prompt_is_encoded_but_not_supervised(qwen_like):
    feature = encode_messages(qwen_like, CONVERSATION[1:3])
    assert qwen_like.decode(feature["input_ids"]).startswith(
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    )
    assert [qwen_like.decode(s) for s in _supervised_spans(feature)] == ["46<|im_end|>\n"]


def test_char_tokenizer_multi_turn_spans():
    tok = char_tokenizer()
    feature = encode_messages(tok, CONVERSATION)
    _check_shift(feature)
    assert [tok.decode(s) for s in _supervised_spans(feature)] == [
        "46<|im_end|>\n",
        "It is Paris.\n\nA city.<|im_end|>\n",
    ]


def test_no_assistant_turn_means_no_supervision():
    feature = encode_messages(char_tokenizer(), CONVERSATION[:2])
    assert set(feature["labels"]) == {IGNORE_INDEX}


def test_truncation_keeps_the_left_and_reshifts():
    tok = char_tokenizer()
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "bc"}]
    full = encode_messages(tok, messages)
    cut = encode_messages(tok, messages, max_length=21)
    assert cut["input_ids"] == full["input_ids"][:21]
    # Position 19 (the prompt's last "\n") predicts "b"; position 20 ("b") has no kept target.
    assert cut["labels"] == [IGNORE_INDEX] * 19 + [full["input_ids"][20], IGNORE_INDEX]
    too_short = encode_messages(tok, messages, max_length=19)
    with pytest.raises(ValueError, match="no supervised token"):
        check_supervised([too_short])


def test_template_that_rewrites_turns_is_rejected(backend):
    with pytest.raises(ValueError, match=r"not prefix-stable at messages\[2\]"):
        encode_messages(_hf(backend, MARKS_LAST), CONVERSATION)


def test_tokens_merging_across_the_turn_boundary_are_rejected(backend):
    # GPT-2's pre-tokenizer splits "\n\nIt" as "\n", "\n", "It" but a trailing "\n\n" as one
    # pre-token, so the generation prompt alone does not tokenize as a prefix of the turn.
    gpt2_split = copy.deepcopy(backend)
    gpt2_split.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok = _hf(gpt2_split, LLAMA_LIKE, bos_token="<|begin_of_text|>")
    prompt = tok.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    assert "ĊĊ" in tok.convert_ids_to_tokens(tok(prompt, add_special_tokens=False)["input_ids"])
    with pytest.raises(ValueError, match="not prefix-stable"):
        encode_messages(tok, CONVERSATION)


def test_tokenizer_without_chat_template_is_rejected(backend):
    with pytest.raises(ValueError, match="has no chat_template"):
        encode_messages(_hf(backend, None), CONVERSATION)


@pytest.mark.parametrize(
    ("messages", "error", "match"),
    [
        ("hi", TypeError, "must be a list of messages"),
        ([], ValueError, "is empty"),
        (["hi"], TypeError, r"messages\[0\] must be a dict"),
        ([{"content": "x"}], ValueError, r"messages\[0\] has no 'role'"),
        ([{"role": "user"}], ValueError, r"messages\[0\] has no 'content'"),
        (
            [{"role": "user", "content": "x"}, {"role": "tool", "content": "x"}],
            ValueError,
            r"messages\[1\]\['role'\] must be one of system, user, assistant; got 'tool'",
        ),
        (
            [{"role": "user", "content": None}],
            TypeError,
            r"messages\[0\]\['content'\] must be a str",
        ),
    ],
)
def test_invalid_messages_name_index_and_field(messages, error, match):
    with pytest.raises(error, match=match):
        validate_messages(messages)
    with pytest.raises(error, match=match):
        encode_messages(char_tokenizer(), messages)


def test_bad_max_length_is_rejected():
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="max_length must be a positive int"):
            encode_messages(char_tokenizer(), CONVERSATION, max_length=bad)
        with pytest.raises(ValueError, match="max_length must be a positive int"):
            encode_text(char_tokenizer(), "hi", max_length=bad)


def test_encode_text_supervises_everything_and_appends_eos():
    tok = char_tokenizer()
    feature = encode_text(tok, "hi!")
    h, i, bang = tok.convert_tokens_to_ids(["h", "i", "!"])
    assert feature == {
        "input_ids": [h, i, bang, tok.eos_token_id],
        "labels": [i, bang, tok.eos_token_id, IGNORE_INDEX],
    }
    assert encode_text(tok, "hi!", max_length=2) == {
        "input_ids": [h, i],
        "labels": [i, IGNORE_INDEX],
    }


def test_encode_text_does_not_double_an_eos_the_tokenizer_adds(backend):
    appending = copy.deepcopy(backend)
    eos = appending.token_to_id("<|endoftext|>")
    appending.post_processor = TemplateProcessing(
        single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", eos)]
    )
    tok = _hf(appending, None)
    assert tok("It is")["input_ids"][-1] == eos
    feature = encode_text(tok, "It is")
    assert feature["input_ids"] == tok("It is")["input_ids"]
    assert feature["input_ids"].count(eos) == 1
    _check_shift(feature)


def test_encode_text_errors(backend):
    with pytest.raises(TypeError, match="text must be a str"):
        encode_text(char_tokenizer(), ["hi"])
    no_eos = PreTrainedTokenizerFast(tokenizer_object=backend)
    with pytest.raises(ValueError, match="has no eos_token"):
        encode_text(no_eos, "hi")
