"""TRL users' GRPO scripts with `from trl import` changed to `from tandem.rl import`, run as written
(a local tiny model and a local dataset in place of the hub's), 3 steps each."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from model_fixtures import make_tiny_model, make_tokenizer

# TRL's quick-start (docs: "GRPO Trainer" / "Quick start"), import changed, names substituted.
TRL_QUICKSTART = '''
from datasets import load_dataset
from tandem.rl import GRPOConfig, GRPOTrainer

dataset = load_dataset("json", data_files="{dataset}", split="train")

# Define the reward function, which rewards completions that are close to 20 characters
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]

training_args = GRPOConfig(output_dir="Qwen2-0.5B-GRPO")
trainer = GRPOTrainer(
    model="{model}",
    reward_funcs=reward_len,
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
'''

# TRL's README example: no GRPOConfig, a hub id, TRL's accuracy_reward (a `solution` column).
TRL_README = '''
from datasets import load_dataset
from tandem.rl import GRPOTrainer
from tandem.rl.rewards import accuracy_reward

dataset = load_dataset("json", data_files="{dataset}", split="train")

trainer = GRPOTrainer(
    model="tiny-org/tiny-llama",
    reward_funcs=accuracy_reward,
    train_dataset=dataset,
)
trainer.train()
'''

# The settings colocated-vLLM TRL scripts pass.
TRL_COLOCATE = '''
from datasets import load_dataset
from tandem.rl import GRPOConfig, GRPOTrainer

dataset = load_dataset("json", data_files="{dataset}", split="train")

def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]

training_args = GRPOConfig(
    output_dir="out-colocate", use_vllm=True, vllm_mode="colocate", save_strategy="no",
    report_to="none", bf16=False, logging_steps=1, max_steps=3, per_device_train_batch_size=4,
    num_generations=4, max_completion_length=16, learning_rate=1e-5, warmup_steps=1,
    remove_unused_columns=False, gradient_checkpointing=True, run_name="tiny", seed=0,
    eval_strategy="no", logging_strategy="steps", vllm_gpu_memory_utilization=0.2,
)
trainer = GRPOTrainer(model="{model}", reward_funcs=reward_len, args=training_args,
                      train_dataset=dataset)
trainer.train()
'''


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-model")
    tok = make_tokenizer()
    model = make_tiny_model("llama", max_position_embeddings=1024)  # TRL's default lengths fit
    model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
    with torch.no_grad():  # a constant residual feature that votes for EOS: completions of ~20
        model.model.embed_tokens.weight[:, 0] = 4.0  # tokens, not TRL's 256 (CPU time)
        model.lm_head.weight[tok.eos_token_id, 0] = 2.0
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def write_dataset(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def run_script(source: str, cwd: Path, monkeypatch) -> dict:
    monkeypatch.chdir(cwd)
    scope: dict = {"__name__": "__main__"}
    exec(compile(source, str(cwd / "script.py"), "exec"), scope)  # noqa: S102 - the script under test
    return scope


def test_trl_quickstart_runs(model_dir, tmp_path, monkeypatch):
    # 3 prompts, TRL's defaults (8 completions per prompt, 8 per batch): 1 epoch is 3 steps
    data = write_dataset(tmp_path / "tldr.jsonl", [{"prompt": p} for p in (
        "The capital of France is", "Once upon a time", "Hello, my name is")])
    scope = run_script(TRL_QUICKSTART.format(dataset=data, model=model_dir), tmp_path, monkeypatch)
    trainer = scope["trainer"]
    assert trainer.global_step == 3
    assert trainer.max_steps == 3 and len(trainer.state.log_history) == 3
    out = tmp_path / "Qwen2-0.5B-GRPO"
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()  # the final save
    assert (out / "checkpoint-3").is_dir()  # save_strategy="steps": at the end, as transformers


def test_trl_readme_example_with_a_hub_id_runs(model_dir, tmp_path, monkeypatch):
    from huggingface_hub import constants

    snap = tmp_path / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / ("c" * 40)
    shutil.copytree(model_dir, snap)
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text("c" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = write_dataset(tmp_path / "math.jsonl", [
        {"prompt": [{"role": "user", "content": f"What is {a} + {a}?"}], "solution": str(2 * a)}
        for a in (1, 2, 3)])
    scope = run_script(TRL_README.format(dataset=data), tmp_path, monkeypatch)
    trainer = scope["trainer"]
    assert trainer.global_step == 3
    assert (tmp_path / "tiny-llama-GRPO" / "model.safetensors").is_file()  # TRL's default output_dir


def test_trl_colocate_settings_run(model_dir, tmp_path, monkeypatch):
    data = write_dataset(tmp_path / "d.jsonl", [{"prompt": f"Count to {i}:"} for i in range(4)])
    scope = run_script(TRL_COLOCATE.format(dataset=data, model=model_dir), tmp_path, monkeypatch)
    trainer = scope["trainer"]
    assert trainer.global_step == 3 and trainer.args.report_to == []
    assert [h["step"] for h in trainer.state.log_history] == [1, 2, 3]
    assert not os.path.exists(tmp_path / "out-colocate" / "model.safetensors")  # save_strategy="no"
    assert not list((tmp_path / "out-colocate").glob("checkpoint-*"))
    assert trainer.scheduler.get_last_lr()[0] < 1e-5  # warmup_steps=1, then linear decay
