"""`twinkle_fn.grpo`: the task's reward, the config's and the loop's refusals (before any
compute), rollouts, and one iteration's record. The reward rising is asserted by
``tests/test_cookbook_grpo.py`` and ``tests/test_cli_rl.py``."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import twinkle_fn as tf
from twinkle_fn import grpo
from twinkle_fn.data import char_tokenizer
from twinkle_fn.testing import tiny_config


def test_the_reward_is_the_digit_fraction():
    assert grpo.reward("12a4") == 0.75 and grpo.reward("") == 0.0 and grpo.reward("007") == 1.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"group_size": 1}, "group_size must be >= 2"),
        ({"ppo_epochs": 0}, "ppo_epochs must be an int >= 1"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be an int"),
        ({"epsilon": -0.1}, "epsilon"),
        ({"beta": -1.0}, "beta"),
    ],
)
def test_a_bad_config_is_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        grpo.GRPOConfig(**kwargs)


def _setup(beta=0.0):
    tokenizer = char_tokenizer()
    config = tiny_config("qwen2", vocab_size=len(tokenizer))
    state = tf.init(tf.models.from_hf_config(config, seed=0), tf.optim.adamw(1e-2))
    sampler = AutoModelForCausalLM.from_config(config).eval()
    grpo.sync(sampler, state, torch.float32)
    rl = grpo.GRPOConfig(prompts_per_step=2, group_size=3, max_new_tokens=2, beta=beta)
    return tokenizer, state, sampler, rl


def test_the_loop_refuses_a_kl_without_reference_and_too_few_prompts_before_any_compute():
    tokenizer, state, sampler, rl = _setup(beta=0.1)
    prompts = grpo.task_prompts(tokenizer, 4, seed=0)
    with pytest.raises(ValueError, match=r"beta = 0\.1 needs a reference model"):
        next(grpo.iterations(state, sampler, tokenizer, prompts, rl, 1))
    rl = grpo.GRPOConfig(prompts_per_step=8)
    with pytest.raises(ValueError, match="4 prompts are fewer than prompts_per_step"):
        next(grpo.iterations(state, sampler, tokenizer, prompts, rl, 1))
    state.check_alive()


def test_rollouts_have_the_group_and_length_asked_and_follow_the_generator():
    tokenizer, _, sampler, _ = _setup()
    prompt = grpo.task_prompts(tokenizer, 1, seed=0)[0]
    draws = [
        grpo.rollouts(sampler, prompt, 3, 5, torch.Generator().manual_seed(7)) for _ in range(2)
    ]
    assert draws[0] == draws[1]
    assert len(draws[0]) == 3 and all(len(c) == 5 for c in draws[0])


def test_an_iteration_updates_the_sampler_to_the_trainers_weights_and_reports():
    """After an iteration (KL on) the sampler holds exactly the trainer's new weights."""
    tokenizer, state, sampler, rl = _setup(beta=0.04)
    reference = grpo.reference_of(sampler)
    before = {n: p.clone() for n, p in sampler.state_dict().items()}
    prompts = grpo.task_prompts(tokenizer, 4, seed=0)
    ((state, record),) = grpo.iterations(
        state, sampler, tokenizer, prompts, rl, 1, reference=reference
    )
    trained = tf.unshard(state)
    assert all(torch.equal(sampler.state_dict()[n], p) for n, p in trained.items())
    assert any(not torch.equal(before[n], p) for n, p in trained.items())
    assert all(torch.equal(reference.state_dict()[n], before[n]) for n in before)
    assert record["step"] == 1 and 0.0 <= record["reward"] <= 1.0
    assert record["tokens"] > 0 and record["train_tokens_per_s"] > 0
    assert record["sync_gb_per_s"] > 0
