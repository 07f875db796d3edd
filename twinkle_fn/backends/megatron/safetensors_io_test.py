import itertools
import json
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from twinkle_fn.backends.megatron.bridge import hf_to_mcore, mcore_to_hf
from twinkle_fn.backends.megatron.safetensors_io import SafetensorsReader, save_hf
from twinkle_fn.testing import tiny_config


def _tensors():
    return {
        "a": torch.arange(24, dtype=torch.float32).reshape(4, 6),
        "b": torch.arange(10, dtype=torch.bfloat16),
        "c": torch.randn(3, 2, 5),
    }


def test_reader_reads_whole_tensors_and_slices_of_a_single_file(tmp_path):
    tensors = _tensors()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with SafetensorsReader(tmp_path) as reader:
        assert sorted(reader.keys()) == ["a", "b", "c"] and "a" in reader and len(reader) == 3
        assert reader.shape("c") == (3, 2, 5)
        for name, t in tensors.items():
            assert torch.equal(reader.get(name), t) and reader.get(name).dtype == t.dtype
        assert torch.equal(reader.get_rows("a", 0, 1, 3), tensors["a"][1:3])
        assert torch.equal(reader.get_rows("a", 1, 2, 5), tensors["a"][:, 2:5])
        assert torch.equal(reader.get_rows("c", 2, 0, 1), tensors["c"][:, :, 0:1])
        assert reader.get_rows("b", 0, 10, 10).shape == (0,)
        with pytest.raises(KeyError, match="'z' is not in the checkpoint"):
            reader.get("z")
        with pytest.raises(ValueError, match="out of range"):
            reader.get_rows("a", 0, 2, 5)
        with pytest.raises(ValueError, match="dim 2 is out of range"):
            reader.get_rows("a", 2, 0, 1)


def test_reader_refuses_a_directory_without_weights(tmp_path):
    with pytest.raises(ValueError, match=r"neither model\.safetensors\.index\.json nor"):
        SafetensorsReader(tmp_path)


def test_save_hf_shards_by_size_and_the_reader_follows_the_index(tmp_path):
    cfg = tiny_config("llama")
    tensors = _tensors()
    weight_map = save_hf(tmp_path, iter(tensors.items()), cfg, max_shard_bytes=130)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert (
        index["weight_map"]
        == weight_map
        == {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00001-of-00002.safetensors",
            "c": "model-00002-of-00002.safetensors",
        }
    )
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    reader = SafetensorsReader(tmp_path)
    for name, t in tensors.items():
        assert torch.equal(reader.get(name), t)

    # A second save replaces the first: no stale shard or index is left for from_pretrained.
    save_hf(tmp_path, [("a", tensors["a"])], cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert load_file(tmp_path / "model.safetensors").keys() == {"a"}


def test_save_hf_writes_views_of_one_tensor_and_refuses_bad_streams(tmp_path):
    cfg = tiny_config("llama")
    fused = torch.arange(12.0).reshape(6, 2)
    q, k = fused[:4], fused[4:]  # views sharing storage, as split_qkv returns
    save_hf(tmp_path / "views", [("q", q), ("k", k)], cfg)
    loaded = load_file(tmp_path / "views" / "model.safetensors")
    assert torch.equal(loaded["q"], q) and torch.equal(loaded["k"], k)
    with pytest.raises(ValueError, match="'q' appears twice"):
        save_hf(tmp_path / "dup", [("q", q), ("q", k)], cfg)
    with pytest.raises(ValueError, match="no tensors"):
        save_hf(tmp_path / "empty", [], cfg)
    assert not list((tmp_path / "dup").glob("*.safetensors"))


class _CountingReader(SafetensorsReader):
    """Counts the bytes each read returns, per tensor, and the whole-tensor reads."""

    def __init__(self, directory):
        super().__init__(directory)
        self.bytes = Counter()
        self.whole = Counter()

    def get(self, name):
        t = super().get(name)
        self.bytes[name] += t.nbytes
        self.whole[name] += 1
        return t

    def get_rows(self, name, dim, start, stop):
        t = super().get_rows(name, dim, start, stop)
        self.bytes[name] += t.nbytes
        return t


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_each_rank_reads_only_its_slices(tmp_path, family):
    cfg = tiny_config(family)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    full = load_file(tmp_path / "model.safetensors")
    tp, pp, ep = 2, 2, 2 if family == "qwen3_moe" else 1
    reader = _CountingReader(tmp_path)
    per_rank = []
    for t, p, e in itertools.product(range(tp), range(pp), range(ep)):
        before = sum(reader.bytes.values())
        hf_to_mcore(
            reader,
            cfg,
            tp_rank=t,
            tp_size=tp,
            pp_rank=p,
            pp_size=pp,
            ep_rank=e,
            ep_size=ep,
            etp_size=tp,
        )
        per_rank.append(sum(reader.bytes.values()) - before)

    def copies(name):
        # Norms and the router are replicated on every tp rank; the rest is split over tp (experts
        # over etp = tp). An expert lives on one ep rank; everything else is replicated over ep.
        replicated = name.endswith("norm.weight") or name.endswith("mlp.gate.weight")
        return (1 if ".experts." in name else ep) * (tp if replicated else 1)

    assert reader.bytes == {name: t.nbytes * copies(name) for name, t in full.items()}
    assert all(".experts." not in n and not n.endswith("_proj.weight") for n in reader.whole)
    assert max(per_rank) < 0.4 * sum(t.nbytes for t in full.values())


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("llama", {}),
        ("mistral", {}),
        ("qwen2", {"tie_word_embeddings": True}),
        ("qwen3", {}),
        ("qwen3_moe", {}),
    ],
)
def test_checkpoint_through_megatron_layout_reproduces_logits(tmp_path, family, overrides):
    """save_pretrained -> reader -> every rank of tp2 pp2 (ep2) -> mcore_to_hf -> save_hf ->
    from_pretrained: same weights, so the logits are bit-identical (same fp32 kernels)."""
    cfg = tiny_config(family, **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(tmp_path / "hf")
    reader = SafetensorsReader(tmp_path / "hf")
    tp, pp, ep = 2, 2, 2 if family == "qwen3_moe" else 1
    local = {
        (t, p, e): hf_to_mcore(
            reader, cfg, tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp, ep_rank=e, ep_size=ep
        )
        for t, p, e in itertools.product(range(tp), range(pp), range(ep))
    }
    stream = mcore_to_hf(local, cfg, tp_size=tp, pp_size=pp, ep_size=ep)
    save_hf(tmp_path / "out", stream, cfg, max_shard_bytes=20_000)
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
