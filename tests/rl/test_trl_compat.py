"""GRPOConfig takes every field of TRL's GRPOConfig and transformers' TrainingArguments: honoured,
ignored with a warning, or refused with a message naming the field and what to do instead."""

import dataclasses
import warnings

import pytest

from tandem.rl import GRPOConfig, trl_compat


def _defaults(cls) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def test_every_training_arguments_field_is_accepted_with_its_default():
    from transformers import TrainingArguments

    values = _defaults(TrainingArguments)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # defaults are silent
        c = GRPOConfig(**values)
    for name in values:  # callbacks read args.<field>
        assert hasattr(c, name), name
    # transformers' default (None in 5.24: tandem's memory plan decides, tandem.rl.memory_plan;
    # False in 5.17, the GPU host's: no checkpointing) is taken as given
    assert c.output_dir == "trainer_output" and c.fsdp is False
    assert c.gradient_checkpointing is values["gradient_checkpointing"]
    assert c.optim == "adamw_torch_fused" and c.logging_steps == 500


def test_every_trl_only_field_is_accepted_with_its_default():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = GRPOConfig(**{k: v for k, (v, _, _) in trl_compat.FIELDS.items()})
    assert c.sync_ref_model is False and c.push_to_hub is False


def test_refused_fields_say_what_to_do():
    with pytest.raises(ValueError, match=r"push_to_hub=True.*save_model.*upload_folder"):
        GRPOConfig(push_to_hub=True)
    with pytest.raises(ValueError, match=r"deepspeed=.*fsdp=True"):
        GRPOConfig(deepspeed="ds_zero3.json")
    with pytest.raises(ValueError, match=r"fp16=True.*bf16=True"):
        GRPOConfig(fp16=True)
    with pytest.raises(ValueError, match=r"vllm_tensor_parallel_size=2.*vllm_mode='server'"):
        GRPOConfig(vllm_tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"optim must be one of.*optimizers=\(optimizer"):
        GRPOConfig(optim="adafactor")  # transformers has it; tandem builds AdamW, SGD and the like
    with pytest.raises(ValueError, match=r"save_strategy='best'"):
        GRPOConfig(save_strategy="best")
    with pytest.raises(ValueError, match=r"fsdp='full_shard offload'.*'offload'"):
        GRPOConfig(fsdp="full_shard offload")


def test_ignored_fields_warn_and_unknown_ones_are_named():
    with pytest.warns(UserWarning, match=r"per_device_eval_batch_size=4 is ignored"):
        GRPOConfig(per_device_eval_batch_size=4)
    with pytest.warns(UserWarning, match=r"use_vllm=False is ignored"):
        GRPOConfig(use_vllm=False)
    with pytest.warns(UserWarning, match=r"does not write to wandb"):
        assert GRPOConfig(report_to=["wandb", "jsonl"]).report_to == ["jsonl"]
    with pytest.raises(TypeError, match=r"'lerning_rate' \(did you mean 'learning_rate'\?\)"):
        GRPOConfig(lerning_rate=1e-5)


def test_trl_spellings_are_honoured():
    from transformers import IntervalStrategy

    c = GRPOConfig(fsdp="full_shard auto_wrap", save_strategy=IntervalStrategy.NO, min_p=None,
                   logging_steps=0.25, eval_strategy="steps")
    assert c.fsdp is True and c.save_strategy == "no" and c.min_p == 0.0
    c = GRPOConfig(vllm_mode="server", vllm_server_host="10.0.0.2", vllm_server_port=8001)
    assert c.vllm_server_base_url == "http://10.0.0.2:8001"
    assert GRPOConfig(logging_steps=0.25).eval_steps == 0.25  # None: logging_steps, as transformers
    with pytest.raises(ValueError, match="logging_steps must be a whole number"):
        GRPOConfig(logging_steps=1.5)


def test_transformers_4_fields_are_accepted_and_their_old_names_point_to_the_new():
    """pyproject admits transformers 4.56, whose TrainingArguments still has fields 5.0 removed:
    each is accepted at its default (the whole TrainingArguments test above runs under 4.56 in
    CI); one that would change training is refused with the name to use."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = GRPOConfig(per_gpu_train_batch_size=None, adafactor=False, fp16_backend="auto",
                       torchdynamo=None, include_num_input_tokens_seen=False)
    assert c.adafactor is False and c.torchdynamo is None
    with pytest.raises(ValueError, match=r"per_gpu_train_batch_size=4.*per_device_train_batch_size"):
        GRPOConfig(per_gpu_train_batch_size=4)
    with pytest.raises(ValueError, match=r"adafactor=True.*optim="):
        GRPOConfig(adafactor=True)
    with pytest.warns(UserWarning, match=r"torchdynamo='inductor' is ignored"):
        GRPOConfig(torchdynamo="inductor")
