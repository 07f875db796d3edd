"""`tiny_config`: the family's own config class, the tiny sizes, overrides on top, unknown
families refused."""

import pytest

from twinkle_fn.testing.configs import _EXTRA, tiny_config


def test_a_tiny_config_is_two_layers_of_hidden_32_and_overrides_win():
    config = tiny_config("mixtral")
    assert config.model_type == "mixtral"
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (2, 32, 96)
    assert config.intermediate_size == 16  # the family's extras win over the shared sizes
    assert tiny_config("mixtral", num_hidden_layers=3, intermediate_size=8).to_dict() == {
        **config.to_dict(),
        "num_hidden_layers": 3,
        "intermediate_size": 8,
    }


def test_an_unknown_family_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"no tiny config for family 'gpt2'; known: llama, "):
        tiny_config("gpt2")
    assert "gpt2" not in _EXTRA
