"""The accelerator test helpers: a child process under Triton's interpreter, the float8 loss
bounds, and (CUDA only) host syncs turned into errors."""

import pytest
import torch

from twinkle_fn.testing.accelerator_checks import (
    assert_within_float8_rounding,
    no_host_sync,
    run_triton_interpreted,
)


def test_the_child_runs_interpreted_with_its_arguments_and_its_failure_is_shown():
    check = (
        "import os, sys; assert os.environ['TRITON_INTERPRET'] == '1'; "
        "assert sys.argv[1:] == ['a', 'b']"
    )
    run_triton_interpreted(check, "a", "b")
    with pytest.raises(AssertionError, match="ZeroDivisionError"):
        run_triton_interpreted("1 / 0")


def test_float8_losses_must_be_within_1_percent_and_not_equal():
    reference = [2.0, 1.5, 1.0]
    assert_within_float8_rounding(reference, [2.01, 1.5, 0.995])
    with pytest.raises(AssertionError, match=r"step 1: .* over 1% apart"):
        assert_within_float8_rounding(reference, [2.0, 1.52, 1.0])
    with pytest.raises(AssertionError, match="the float8 path did not run"):
        assert_within_float8_rounding(reference, list(reference))
    with pytest.raises(ValueError):
        assert_within_float8_rounding(reference, [2.0, 1.5])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="host-sync detection is CUDA's")
def test_a_host_sync_inside_the_block_raises_and_the_mode_is_restored():
    x = torch.ones(2, device="cuda")
    with pytest.raises(RuntimeError), no_host_sync():
        x.sum().item()
    assert torch.cuda.get_sync_debug_mode() == 0
