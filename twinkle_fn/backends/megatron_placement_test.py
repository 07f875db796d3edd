"""`place` refuses options the mesh and the backend decide; building, loading and wrapping the
stage on every mesh is checked end to end in `megatron_test.py`."""

import pytest

import twinkle_fn as tf
from twinkle_fn.backends.megatron_placement import place
from twinkle_fn.testing import tiny_config


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"tensor_model_parallel_size": 2}, "set by the mesh"),
        ({"virtual_pipeline_model_parallel_size": 2}, "virtual pipeline"),
        ({"num_micro_batches": 0}, "num_micro_batches must be a positive int"),
    ],
)
def test_options_the_backend_decides_are_refused(options, match):
    model = tf.models.from_hf_config(
        tiny_config("qwen2"), seed=0, backend="megatron", options=options
    )
    with pytest.raises(ValueError, match=match):
        place(model, tf.Mesh())
