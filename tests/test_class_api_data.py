"""`twinkle.template.Template`, `twinkle.processor.InputProcessor`, `twinkle.dataset.Dataset`
and `twinkle.dataloader.DataLoader`, against the core's data functions and by hand."""

import importlib.util
import json

import pytest
import torch

from twinkle import DeviceMesh
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.processor import InputProcessor, unpack
from twinkle.template import Template
from twinkle_fn.data import char_tokenizer, encode_messages, pack, pad_collate
from twinkle_fn.testing import random_features

CHAT = {
    "messages": [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
    ]
}


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def _chat(answer):
    return {
        "messages": [
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": answer},
        ]
    }


def test_template_labels_assistant_turns_only(tok):
    feature = Template(tok).encode(CHAT)
    assert feature["input_ids"] == encode_messages(tok, CHAT["messages"])["input_ids"]
    n = len(feature["input_ids"])
    assert feature["length"] == n and feature["attention_mask"] == [1] * n
    assert feature["position_ids"] == list(range(n))
    # shifted labels: position t predicts token t + 1, supervised on "5<|im_end|>\n" only
    targets = [tok.decode([t]) for t in feature["labels"] if t != -100]
    assert targets == ["5", "<|im_end|>", "\n"]
    assert feature["labels"][-1] == -100
    for t, label in enumerate(feature["labels"]):
        assert label in (-100, feature["input_ids"][t + 1] if t + 1 < n else None)


def test_template_default_system_and_batch_encode(tok):
    template = Template(tok, default_system="Be brief.")
    with_system = template.encode(CHAT)
    messages = [{"role": "system", "content": "Be brief."}, *CHAT["messages"]]
    assert with_system["input_ids"] == encode_messages(tok, messages)["input_ids"]
    assert len(template.batch_encode([CHAT, CHAT])) == 2
    assert template.decode(with_system["input_ids"]).startswith("<|im_start|>system\nBe brief.")


def test_truncation_strategies(tok):
    full = Template(tok).encode(_chat("0123456789"))
    n = len(full["input_ids"])
    right = Template(tok, max_length=n - 4, truncation_strategy="right").encode(_chat("0123456789"))
    assert right["input_ids"] == full["input_ids"][: n - 4]
    assert right["labels"] == [*full["labels"][: n - 5], -100]
    left = Template(tok, max_length=n - 4, truncation_strategy="left").encode(_chat("0123456789"))
    assert left["input_ids"] == full["input_ids"][4:] and left["labels"] == full["labels"][4:]
    assert Template(tok, max_length=5, truncation_strategy="delete").encode(CHAT) is None
    assert Template(tok, max_length=5, truncation_strategy="delete").batch_encode([CHAT]) == []
    with pytest.raises(ValueError, match=r"tokens > max_length=5"):
        Template(tok, max_length=5).encode(CHAT)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda t: Template(t, truncation_strategy="split"), "truncation_strategy must be one of"),
        (lambda t: Template(t, use_chat_template=False), "use_chat_template=False"),
        (lambda t: Template(t).encode({**CHAT, "images": ["x.png"]}), "'images' is not supported"),
        (lambda t: Template(t).encode({"text": "hi"}), "a trajectory is a dict with 'messages'"),
        (lambda t: Template(t).encode(CHAT, add_generation_prompt=True), "no sampler"),
        (lambda t: Template("/nonexistent"), "not a directory with a config.json"),
    ],
)
def test_template_errors(tok, call, match):
    with pytest.raises(ValueError, match=match):
        call(tok)


def test_processor_pads_or_packs_like_the_core():
    feats = random_features(3)
    padded = InputProcessor(pad_token_id=7)(feats)
    for key, value in pad_collate(feats, 7).items():
        assert torch.equal(padded[key], value)
    packed = InputProcessor(padding_free=True)(feats)
    ref = pack(feats)
    assert torch.equal(packed["input_ids"], ref["input_ids"])
    assert torch.equal(packed["cu_seqlens"], ref["cu_seqlens"])
    # per-token values of the packed row come back one row per sample, like the padded batch
    rows = unpack(packed["labels"], packed)
    assert torch.equal(rows.masked_fill(padded["attention_mask"] == 0, -100), padded["labels"])
    tensors = [{k: torch.tensor(v) for k, v in f.items()} for f in feats]
    assert torch.equal(
        InputProcessor()(tensors)["input_ids"],
        padded["input_ids"].masked_fill(padded["attention_mask"] == 0, 0),
    )
    assert InputProcessor()(padded) == padded  # an already collated batch passes through
    with pytest.raises(ValueError, match="padding_side must be 'right'"):
        InputProcessor(padding_side="left")
    with pytest.raises(ValueError, match="framework='megatron' is not available"):
        InputProcessor(framework="megatron")


def test_dataset_rows_jsonl_map_filter_encode(tok, tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps(_chat(str(i))) for i in range(6)) + "\n")
    from_file = Dataset(DatasetMeta(dataset_id=str(path), data_slice=range(1, 5)))
    assert len(from_file) == 4 and from_file[0] == _chat("1")
    ds = Dataset(DatasetMeta(data=[{"q": "Q", "a": str(i)} for i in range(6)]))
    # map is batched (columns in, columns out) and merges its columns into the rows
    ds.map(lambda batch: {"messages": [_chat(a)["messages"] for a in batch["a"]]})
    assert ds[0]["q"] == "Q" and ds[0]["messages"] == _chat("0")["messages"]
    ds.filter(lambda row: row["messages"][1]["content"] not in ("0", "5"))
    assert [row["messages"][1]["content"] for row in ds[:]] == ["1", "2", "3", "4"]
    ds.add_dataset(DatasetMeta(data=[_chat("9")]))
    ds.set_template(Template(tok))
    ds.encode()
    assert len(ds) == 5 and ds[0] == Template(tok).encode(_chat("1"))

    class Upper:
        def __init__(self, suffix):
            self.suffix = suffix

        def __call__(self, batch):
            return {"tag": [self.suffix] * len(batch["input_ids"])}

    ds.map(Upper, init_args={"suffix": "!"})
    assert ds[0]["tag"] == "!"


def test_dataset_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        Dataset(DatasetMeta(dataset_id=str(tmp_path / "missing.jsonl")))
    with pytest.raises(ValueError, match="needs data="):
        Dataset(DatasetMeta())
    with pytest.raises(ValueError, match="needs a template"):
        Dataset(DatasetMeta(data=[CHAT])).encode()
    with pytest.raises(TypeError, match="expected a dict"):
        Dataset(DatasetMeta(data=[CHAT])).map(lambda row: 1)
    if importlib.util.find_spec("datasets") is None:
        with pytest.raises(ValueError, match="needs the `datasets` package"):
            Dataset(DatasetMeta(dataset_id="hf://org/name"))


def test_dataset_reads_an_hf_dataset():
    datasets = pytest.importorskip("datasets")
    hf = datasets.Dataset.from_list([_chat("1"), _chat("2")])
    assert Dataset(DatasetMeta(data=hf))[1] == _chat("2")


def _rank_batches(monkeypatch, mesh, rank, **kwargs):
    monkeypatch.setenv("RANK", str(rank))
    return list(DataLoader(list(range(22)), device_mesh=mesh, **kwargs))


def test_each_data_rank_gets_its_contiguous_share(monkeypatch):
    mesh = DeviceMesh.from_sizes(dp_size=2, fsdp_size=2, tp_size=2)
    per_rank = {r: _rank_batches(monkeypatch, mesh, r, batch_size=8) for r in range(8)}
    # 22 rows: batches of 8, 8, then 6 (>= 4 data ranks, so kept), split 2/2/1/1
    for r, batches in per_rank.items():
        monkeypatch.setenv("RANK", str(r))
        assert [len(b) for b in batches] == ([2, 2, 2] if mesh.data_rank < 2 else [2, 2, 1])
    for step in range(3):
        by_data_rank = {}
        for r in range(8):
            monkeypatch.setenv("RANK", str(r))
            by_data_rank.setdefault(mesh.data_rank, per_rank[r][step])
            assert per_rank[r][step] == by_data_rank[mesh.data_rank]  # tp peers agree
        rows = [x for d in range(4) for x in by_data_rank[d]]
        assert rows == list(range(22))[8 * step : 8 * step + 8]
    shuffled = {
        r: _rank_batches(monkeypatch, mesh, r, batch_size=8, shuffle=True) for r in (0, 2, 4, 6)
    }
    assert sorted(x for r in shuffled for b in shuffled[r] for x in b) == list(range(22))


def test_dataloader_resume_and_length(monkeypatch):
    loader = DataLoader([{"i": i} for i in range(10)], batch_size=4)
    assert len(loader) == 3  # 4, 4, 2
    first = list(loader)
    assert [len(b) for b in first] == [4, 4, 2] and loader.get_state() == {
        "consumed_train_samples": 12
    }
    loader.skip_consumed_samples(4)
    assert len(loader) == 2 and next(iter(loader))[0] == {"i": 4}
    loader.resume_from_checkpoint(8)
    assert [b[0]["i"] for b in loader] == [8]
    assert len(DataLoader(list(range(10)), batch_size=4, drop_last=True)) == 2
    assert len(DataLoader(list(range(10)), batch_size=4, min_batch_size=3)) == 2


def test_batch_must_divide_over_data_ranks():
    with pytest.raises(ValueError, match=r"batch_size=6 .* divisible by the mesh's 4 data ranks"):
        DataLoader(
            list(range(8)), batch_size=6, device_mesh=DeviceMesh.from_sizes(dp_size=2, fsdp_size=2)
        )
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        DataLoader(list(range(8)), batch_size=0)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".txt"])
def test_dataset_files_that_are_binary_or_empty_are_named(tmp_path, suffix):
    """Today a binary file gave a bare UnicodeDecodeError and an empty one an empty dataset."""
    binary = tmp_path / f"bin{suffix}"
    binary.write_bytes(b"text\nok\n\x89PNG\r\n\x1a\n")
    with pytest.raises(ValueError, match=rf"bin\{suffix}:3: not UTF-8 text \(byte 0x89"):
        Dataset(DatasetMeta(dataset_id=str(binary)))
    binary.unlink()
    empty = tmp_path / f"empty{suffix}"
    empty.write_text("" if suffix != ".json" else "[]")
    with pytest.raises(ValueError, match=rf"empty\{suffix} has no rows"):
        Dataset(DatasetMeta(dataset_id=str(tmp_path)))


def test_dataset_row_errors_name_the_file_line_and_field(tok, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(f'{json.dumps(_chat("1"))}\n\n{{"prompt": "no messages"}}\n')
    ds = Dataset(DatasetMeta(dataset_id=str(path)))
    ds.add_dataset(DatasetMeta(data=[{"prompt": "in memory"}]))
    ds.set_template(Template(tok))
    with pytest.raises(ValueError, match=r"^row 1 \(.*d\.jsonl:3\): .*'messages'.*\['prompt'\]"):
        ds.encode()
    ds.filter(lambda row: "messages" in row or row["prompt"] == "in memory")
    with pytest.raises(ValueError, match=r"^row 1 \(DatasetMeta\.data\[0\]\): .*'messages'"):
        ds.encode()
    lines = tmp_path / "l.jsonl"
    lines.write_text('{"text": "a"}\n[1, 2]\n')
    with pytest.raises(TypeError, match=r"l\.jsonl:2: a row must be a JSON object .*got list"):
        Dataset(DatasetMeta(dataset_id=str(lines)))
