"""`place` refuses, through `read_options`, the options the mesh and the backend decide and own
options of the wrong type or range, naming them; megatron-core's own router losses are
`router_test`'s."""

import pytest

import twinkle_fn as tf
from twinkle_fn.backends.megatron.placement import place
from twinkle_fn.backends.megatron.placement_options import read_options
from twinkle_fn.testing import tiny_config


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"tensor_model_parallel_size": 2}, "set by the mesh"),
        ({"virtual_pipeline_model_parallel_size": 2}, "virtual pipeline"),
        ({"num_micro_batches": 0}, "num_micro_batches must be a positive int"),
        ({"overlap_grad_reduce": 1}, "overlap_grad_reduce must be a bool"),
        ({"grouped_experts": "yes"}, "grouped_experts must be a bool"),
        ({"grad_bucket_size": 0}, "grad_bucket_size must be a positive int"),
    ],
)
def test_options_the_backend_decides_are_refused(options, match):
    model = tf.models.from_hf_config(
        tiny_config("qwen2"), seed=0, backend="megatron", options=options
    )
    with pytest.raises(ValueError, match=match):
        place(model, tf.Mesh())


def test_own_options_are_read_and_the_rest_pass_through_to_megatron():
    got = read_options({"hidden_dropout": 0.0, "overlap_grad_reduce": False}, tf.Mesh(pp=2))
    assert got.overrides == {"hidden_dropout": 0.0}
    assert (got.num_micro_batches, got.overlap_grad_reduce, got.grouped_experts) == (2, False, True)
