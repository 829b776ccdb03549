"""LoRA via peft: the engine gets the merged weights after each sync (a fresh engine on the merged
model generates the same greedy tokens), the sync check catches a sync without the adapter, the
base weights stay untouched, and a tiny model learns the toy task training only the adapter."""

import copy

import pytest
import torch
from datasets import Dataset
from model_fixtures import make_tiny_model, make_tokenizer

from tandem import LLM, SamplingParams
from tandem.rl import GRPOConfig, GRPOTrainer, lora

peft = pytest.importorskip("peft")

TARGET = 42
PROMPTS = ["Hello, my name is", "The capital of France is", "What is 2 + 3?", "Once upon a time",
           "one two three", "The answer is", "I generate text", "small model"]
ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def target_share(prompts, completions, completion_ids, **kwargs):
    return [sum(t == TARGET for t in ids) / max(1, len(ids)) for ids in completion_ids]


def make(tmp_path, peft_config, **overrides):
    cfg = {
        "output_dir": str(tmp_path), "num_generations": 8, "per_device_train_batch_size": 16,
        "gradient_accumulation_steps": 2, "max_completion_length": 8, "max_prompt_length": 32,
        "learning_rate": 3e-2, "max_steps": 12, "report_to": "none", "gradient_checkpointing": False,
        "lr_scheduler_type": "constant", "seed": 0, "save_strategy": "no", "bf16": False,
    }
    cfg.update(overrides)
    return GRPOTrainer(make_tiny_model("llama", seed=3), target_share, GRPOConfig(**cfg),
                       train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=make_tokenizer(),
                       peft_config=peft_config, engine_kwargs={"device": "cpu"})


def test_engine_after_sync_equals_a_fresh_engine_on_the_merged_weights(tmp_path):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEARS, init_lora_weights=False)
    trainer = make(tmp_path, config, max_steps=4)
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "base_layer" in n}
    for _ in range(2):
        trainer.step()
    assert all(torch.equal(p, base[n]) for n, p in trainer.model.named_parameters() if n in base)
    assert all("lora_" in n for n, p in trainer.model.named_parameters() if p.requires_grad)
    trainer.generator.sync()
    prompt_ids = [trainer.tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS[:4]]
    got = trainer.generator.greedy(prompt_ids, 8)[1]
    merged = copy.deepcopy(trainer.model).merge_and_unload()
    fresh = LLM(merged, tokenizer=trainer.tokenizer, device="cpu", dtype="float32", max_model_len=64)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    want = [o.outputs[0].token_ids for o in fresh.generate(
        [{"prompt_token_ids": ids} for ids in prompt_ids], greedy, use_tqdm=False)]
    assert [list(g) for g in got] == [list(w) for w in want]
    # and the adapter moved the engine: the base model alone answers otherwise
    unmerged = copy.deepcopy(trainer.model).unload()
    base_llm = LLM(unmerged, tokenizer=trainer.tokenizer, device="cpu", dtype="float32", max_model_len=64)
    assert [o.outputs[0].token_ids for o in base_llm.generate(
        [{"prompt_token_ids": ids} for ids in prompt_ids], greedy, use_tqdm=False)] != want


def test_a_sync_without_the_adapter_is_caught(tmp_path):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    trainer = make(tmp_path, config, max_steps=2)
    sync = trainer.generator.weight_sync

    def base_only():  # what a sync that forgot the merge would send
        for name, p in trainer.model.get_base_model().named_parameters():
            if "lora_" not in name:
                yield name.replace(".base_layer", ""), p.detach()

    sync.weights = base_only
    with pytest.raises(RuntimeError, match="merged LoRA weight"):
        sync.sync()


def test_merged_weights_names_are_the_base_models():
    model = make_tiny_model("llama")
    names = [n for n, _ in model.named_parameters()]
    wrapped = lora.apply_peft(copy.deepcopy(model), peft.LoraConfig(r=2, target_modules=["q_proj", "down_proj"]))
    merged = dict(lora.merged_weights(wrapped))
    assert list(merged) == names
    for n, p in model.named_parameters():  # B starts at 0: merged == base
        assert torch.equal(merged[n], p)


def test_tiny_model_learns_with_lora(tmp_path):
    trainer = make(tmp_path, peft.LoraConfig(r=8, lora_alpha=16, target_modules=ALL_LINEARS))
    rewards = [trainer.step()["reward"] for _ in range(12)]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.2, rewards
    out = trainer.save_model(str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file(), out


def test_a_lora_run_resumes_exactly(tmp_path):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEARS)
    straight = make(tmp_path / "a", config, max_steps=6)
    straight.step()
    path = straight.save_checkpoint()
    assert (path / "adapter_model.safetensors").is_file()
    expected = straight.step()
    resumed = make(tmp_path / "b", config, max_steps=6)
    resumed._resume(str(path))
    got = resumed.step()
    assert got["reward"] == pytest.approx(expected["reward"], abs=1e-6)
    assert got["loss"] == pytest.approx(expected["loss"], abs=1e-5)


@pytest.mark.gpu
def test_lora_sync_on_the_gpu_in_bf16_equals_a_fresh_engine(tmp_path):
    """On CUDA: the merged weights go device to device in bf16; greedy equals a fresh bf16 engine."""
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=ALL_LINEARS, init_lora_weights=False)
    cfg = {"output_dir": str(tmp_path), "num_generations": 8, "per_device_train_batch_size": 16,
           "max_completion_length": 8, "max_prompt_length": 32, "learning_rate": 1e-2, "max_steps": 4,
           "report_to": "none", "save_strategy": "no", "bf16": True, "seed": 0,
           "vllm_gpu_memory_utilization": 0.1}
    trainer = GRPOTrainer(make_tiny_model("llama", seed=3), target_share, GRPOConfig(**cfg),
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                          processing_class=make_tokenizer(), peft_config=config)
    for _ in range(2):
        trainer.step()
    trainer.generator.sync()
    prompt_ids = [trainer.tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS[:4]]
    got = trainer.generator.greedy(prompt_ids, 8)[1]
    merged = copy.deepcopy(trainer.model).merge_and_unload()
    fresh = LLM(merged, tokenizer=trainer.tokenizer, dtype="bfloat16", max_model_len=64,
                gpu_memory_utilization=0.1)
    want = [o.outputs[0].token_ids for o in fresh.generate(
        [{"prompt_token_ids": ids} for ids in prompt_ids], SamplingParams(temperature=0, max_tokens=8),
        use_tqdm=False)]
    assert [list(g) for g in got] == [list(w) for w in want]


def test_lora_with_kl_uses_the_model_with_its_adapter_off_as_reference(tmp_path):
    trainer = make(tmp_path, peft.LoraConfig(r=4, target_modules=ALL_LINEARS), beta=0.1, max_steps=4)
    assert isinstance(trainer.ref_model, lora.AdapterDisabled)
    first = trainer.step()  # B starts at 0: the policy is the reference
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)
    second = trainer.step()
    assert second["kl"] > 0.0
