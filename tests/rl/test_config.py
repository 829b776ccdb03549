"""GRPOConfig: derived batch sizes, TRL-compatible values, and errors that say what to change."""

from __future__ import annotations

import pytest

from tandem.rl import GRPOConfig


def test_defaults_follow_trl():
    c = GRPOConfig()
    assert (c.loss_type, c.beta, c.epsilon, c.epsilon_high, c.num_generations) == (
        "dapo",
        0.0,
        0.2,
        0.2,
        8,
    )
    assert c.steps_per_generation == c.gradient_accumulation_steps == 1
    assert c.generation_batch_size == 8 and c.prompts_per_generation == 1
    assert (
        c.vllm_importance_sampling_correction and c.vllm_importance_sampling_mode == "sequence_mask"
    )
    assert c.vllm_importance_sampling_clip_max == 3.0 and c.scale_rewards == "group"


def test_generation_batch_is_derived_either_way():
    c = GRPOConfig(per_device_train_batch_size=8, gradient_accumulation_steps=4)
    assert (c.steps_per_generation, c.generation_batch_size) == (4, 32)
    c = GRPOConfig(per_device_train_batch_size=8, steps_per_generation=2)
    assert c.generation_batch_size == 16
    c = GRPOConfig(per_device_train_batch_size=4, generation_batch_size=32)
    assert c.steps_per_generation == 8 and c.prompts_per_generation == 4
    with pytest.raises(
        ValueError, match="only one of generation_batch_size and steps_per_generation"
    ):
        GRPOConfig(generation_batch_size=16, steps_per_generation=2)
    with pytest.raises(
        ValueError, match=r"generation_batch_size \(12\) must be a multiple of per_device"
    ):
        GRPOConfig(per_device_train_batch_size=8, generation_batch_size=12)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_generations": 1}, "num_generations must be >= 2"),
        (
            {"per_device_train_batch_size": 6},
            (
                r"generation_batch_size \(6 = .*\) must be a multiple of "
                r"num_generations \(8\).*change per_device_train_batch_size"
            ),
        ),
        ({"epsilon": 0.0}, "epsilon must be > 0"),
        ({"epsilon_high": -0.1}, "epsilon_high must be > 0"),
        ({"loss_type": "dapoo"}, "loss_type must be one of .*did you mean 'dapo'"),
        ({"scale_rewards": "grup"}, "scale_rewards must be one of"),
        ({"importance_sampling_level": "seq"}, "importance_sampling_level"),
        (
            {"vllm_importance_sampling_mode": "token_clip"},
            "vllm_importance_sampling_mode must be one of",
        ),
        (
            {"vllm_importance_sampling_clip_min": 3.0},
            r"clip_min \(3.0\) must be < .*clip_max \(3.0\)",
        ),
        (
            {
                "vllm_importance_sampling_mode": "token_truncate",
                "vllm_importance_sampling_clip_max": None,
            },
            "needs vllm_importance_sampling_clip_max or",
        ),
        ({"temperature": 0.0}, "temperature must be > 0"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"lr_scheduler_type": "reduce_lr_on_plateau"}, "lr_scheduler_type must be one of"),
        ({"max_steps": 0}, "max_steps must be -1"),
        ({"engine_sleep_level": 3}, "engine_sleep_level must be 1"),
        ({"vllm_gpu_memory_utilization": 1.5}, "vllm_gpu_memory_utilization"),
        ({"vllm_gpu_memory_utilization": "most"}, "vllm_gpu_memory_utilization must be 'auto'"),
        ({"optim_offload": True, "fsdp": True}, "optim_offload=True runs on one GPU"),
        ({"vllm_mode": "remote"}, "vllm_mode must be one of"),
        ({"fsdp": True, "vllm_mode": "server", "vllm_server_base_url": "http://h:8000"},
         "with vllm_mode='server' use fsdp=False"),
        ({"report_to": ["tensorbored"]}, "report_to entry must be one of"),
        ({"save_total_limit": 0}, "save_total_limit must be >= 1"),
        ({"beta": -1.0}, "beta must be >= 0"),
        ({"max_tokens_per_micro_batch": 4096}, r"max_tokens_per_micro_batch \(4096\) .*needs padding_free=True"),
        ({"share_prompts": True}, r"share_prompts=True packs each prompt once .*needs padding_free=True"),
        ({"max_tokens_per_micro_batch": 0, "padding_free": True}, "max_tokens_per_micro_batch must be >= 1"),
        (
            {"max_tokens_per_micro_batch": 700, "padding_free": True},
            (
                r"max_tokens_per_micro_batch \(700\) must be >= max_prompt_length \+ "
                r"max_completion_length \(768\)"
            ),
        ),
    ],
)
def test_errors_say_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(**kwargs)


def test_a_token_budget_is_checked_against_what_can_be_checked():
    c = GRPOConfig(padding_free=True, max_tokens_per_micro_batch=768)  # 512 + 256: the longest fits
    assert c.max_tokens_per_micro_batch == 768
    # no prompt limit: the trainer checks each step's longest row instead
    assert GRPOConfig(padding_free=True, max_prompt_length=None, max_tokens_per_micro_batch=300)


def test_trl_value_aliases():
    assert GRPOConfig(scale_rewards=True).scale_rewards == "group"
    assert GRPOConfig(scale_rewards=False).scale_rewards == "none"
    with pytest.warns(FutureWarning, match="vllm_importance_sampling_cap is deprecated"):
        c = GRPOConfig(vllm_importance_sampling_cap=2.0)
    assert c.vllm_importance_sampling_clip_max == 2.0
    assert GRPOConfig(epsilon=0.1).epsilon_high == 0.1
    assert GRPOConfig(report_to="none").report_to == []
    assert GRPOConfig(report_to="all").report_to == ["jsonl", "tensorboard"]
    # transformers 4's default (every integration installed), which a TRL script may pass on
    assert GRPOConfig(report_to=None).report_to == ["jsonl", "tensorboard"]
    assert GRPOConfig(report_to="jsonl, jsonl").report_to == ["jsonl"]


def test_dict_round_trip():
    c = GRPOConfig(per_device_train_batch_size=16, steps_per_generation=2, epsilon_high=0.28)
    assert GRPOConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match=r"'num_generation' \(did you mean 'num_generations'\?\)"):
        GRPOConfig.from_dict({"num_generation": 4})
