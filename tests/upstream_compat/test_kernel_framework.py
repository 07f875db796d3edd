"""`twinkle.utils.framework.Torch` and `twinkle.kernel`, as upstream's cookbook scripts call
them: no NPU here, an empty kernel mapping changes nothing, and asking for a kernel bundle says
which package it needs."""

import importlib.util

import pytest
import torch

from twinkle.kernel import kernelize, liger_builtin, npu_builtin
from twinkle.utils.framework import Torch


def test_device_queries():
    assert Torch.is_torch_available()
    assert Torch.is_gpu_available() == torch.cuda.is_available()
    has_npu_package = importlib.util.find_spec("torch_npu") is not None
    assert Torch.is_torch_npu_available() == has_npu_package
    if not has_npu_package:
        assert not Torch.is_npu_available()
    expected = "cuda:1" if torch.cuda.is_available() else "cpu"
    assert Torch.get_device(1) == expected


def test_empty_mapping_is_a_no_op():
    model = torch.nn.Linear(2, 2)
    assert kernelize(model, {}) is model


def test_kernel_requests_say_what_is_missing():
    with pytest.raises(ValueError, match="liger_builtin: the liger_kernel package"):
        liger_builtin(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="npu_builtin: the torch_npu package"):
        npu_builtin()
    with pytest.raises(ValueError, match="replaces no kernels, and the mapping asks for 1"):
        kernelize(torch.nn.Linear(2, 2), {"Qwen3RMSNorm": object()})
