"""twinkle_fn/models/_family_row.py: a row refuses values no backend reads."""

import dataclasses

import pytest

from twinkle_fn.models.families import ROWWISE, family
from twinkle_fn.testing import tiny_config


def test_rows_refuse_values_no_backend_reads():
    row = family("qwen2")
    with pytest.raises(ValueError, match="tp_plan styles"):
        dataclasses.replace(row, tp_plan={"self_attn.q_proj": "diagonal"})
    with pytest.raises(ValueError, match="rope 'alibi'"):
        dataclasses.replace(row, rope="alibi")
    with pytest.raises(ValueError, match="o_bias=''"):
        dataclasses.replace(row, o_bias="")
    with pytest.raises(ValueError, match="bias part 'lm_head'"):
        row.has_bias("lm_head", tiny_config("qwen2"))
    with pytest.raises(TypeError):
        row.tp_plan["mlp.up_proj"] = ROWWISE
