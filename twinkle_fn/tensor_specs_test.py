"""Safetensors headers are read without the data and a truncated file is named; specs are compared
naming the tensor, both shapes or dtypes and the file; NaN is found and named."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from twinkle_fn.tensor_specs import (
    TensorSpec,
    check_finite,
    check_specs,
    module_specs,
    nonfinite,
    safetensors_specs,
)


def _write(directory, tensors, name="model.safetensors"):
    directory.mkdir(exist_ok=True)
    save_file(tensors, directory / name)
    return directory / name


TENSORS = {
    "a": torch.ones(3, 4),
    "b": torch.zeros(5, dtype=torch.bfloat16),
    "c": torch.arange(6, dtype=torch.int64).view(2, 3),
}


def test_headers_give_what_safetensors_reads(tmp_path):
    file = _write(tmp_path, TENSORS)
    specs = safetensors_specs(tmp_path)
    with safe_open(file, framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            t = f.get_tensor(key)
            assert specs[key] == TensorSpec(tuple(t.shape), t.dtype, file)
    assert safetensors_specs(tmp_path, rename=lambda k: f"x.{k}").keys() == {"x.a", "x.b", "x.c"}


@pytest.mark.parametrize("keep", [4, 40, -1])
def test_a_truncated_file_is_named(tmp_path, keep):
    file = _write(tmp_path, TENSORS)
    data = file.read_bytes()
    file.write_bytes(data[:keep])
    with pytest.raises(ValueError, match=r"model\.safetensors.*truncated"):
        safetensors_specs(tmp_path)


def test_no_weights_and_a_key_in_two_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"holds no \.safetensors weights"):
        safetensors_specs(tmp_path)
    _write(tmp_path, {"a": torch.ones(1)}, "one.safetensors")
    _write(tmp_path, {"a": torch.ones(1)}, "two.safetensors")
    with pytest.raises(ValueError, match=r"'a' is in both .*one.safetensors and .*two"):
        safetensors_specs(tmp_path)


def test_check_specs_names_tensor_shapes_dtypes_and_file(tmp_path):
    _write(tmp_path, TENSORS)
    found = safetensors_specs(tmp_path)
    expected = {n: TensorSpec.of(t) for n, t in TENSORS.items()}
    check_specs(found, expected, where="here")
    with pytest.raises(ValueError, match=r"here lacks 1 tensors the model has, e.g. \['d'\]"):
        check_specs(found, {**expected, "d": TensorSpec((1,), torch.float32)}, where="here")
    check_specs(found, {**expected, "d": TensorSpec((1,), torch.float32)}, where="x", optional="d")
    with pytest.raises(ValueError, match=r"holds 1 tensors the model lacks, e.g. \['c'\] \(in .*"):
        check_specs(found, {k: v for k, v in expected.items() if k != "c"}, where="here")
    wide = {**expected, "a": TensorSpec((3, 8), torch.float32)}
    with pytest.raises(
        ValueError, match=r"'a' has shape \(3, 4\) in .*model.safetensors, .*\(3, 8\)"
    ):
        check_specs(found, wide, where="here")
    fp32 = {**expected, "b": TensorSpec((5,), torch.float32)}
    with pytest.raises(ValueError, match=r"'b' is torch.bfloat16 in .*expects torch.float32"):
        check_specs(found, fp32, where="here")
    check_specs(found, fp32, where="here", cast=True)  # a bf16 release into fp32 weights
    floats = {**expected, "c": TensorSpec((2, 3), torch.float32)}
    with pytest.raises(ValueError, match=r"'c' is torch.int64"):
        check_specs(found, floats, where="here", cast=True)


def test_check_finite_names_the_tensor_and_its_file(tmp_path):
    _write(tmp_path, TENSORS)
    files = safetensors_specs(tmp_path)
    check_finite(TENSORS, where="here", files=files)
    for bad in (float("nan"), float("inf")):
        a = TENSORS["a"].clone()
        a[1, 2] = bad
        with pytest.raises(ValueError, match=r"here: tensor 'a' in .*model.safetensors holds NaN"):
            check_finite({**TENSORS, "a": a}, where="here", files=files)


def test_nonfinite_tells_an_overflowing_sum_from_a_nonfinite_value():
    """The fast check sums each tensor: finite values whose sum overflows (two bf16 maxima) are
    still finite; the first non-finite tensor in the mapping's order is named."""
    big = torch.full((2,), torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16)
    assert not torch.isfinite(big.sum())
    assert nonfinite({"big": big, "h": torch.ones(3, dtype=torch.float16) * 6e4}) is None
    nan, inf = torch.tensor([1.0, float("nan")]), torch.tensor([float("-inf")])
    assert nonfinite({"ok": torch.ones(2), "inf": inf, "nan": nan}) == "inf"
    assert nonfinite({"ids": torch.tensor([1, 2]), "nan": nan.bfloat16()}) == "nan"


def test_module_specs_mark_tied_aliases():
    emb = torch.nn.Embedding(4, 3)
    head = torch.nn.Linear(3, 4, bias=False)
    head.weight = emb.weight
    module = torch.nn.ModuleDict({"emb": emb, "head": head})
    specs, aliases = module_specs(module)
    assert specs == {n: TensorSpec((4, 3), torch.float32) for n in ("emb.weight", "head.weight")}
    assert aliases == {"head.weight"}
