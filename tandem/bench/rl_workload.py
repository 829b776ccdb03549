"""The `tandem bench rl` workload, shared by its modes (rl.py: tandem vs TRL; rl_modes.py:
colocate vs server): the config, the random-weight model and prompts, the batching, the reward."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import torch

from tandem.bench.synthetic_tokenizer import ids_to_text, synthetic_tokenizer


@dataclass
class RLBenchConfig:
    model: str = "qwen2.5-1.5b"
    num_prompts: int = 32
    num_generations: int = 8
    prompt_len: int = 128
    completion_len: int = 256
    # "uniform:LO-HI": each prompt's completions run to a length drawn from LO-HI (rl_lengths.py)
    completion_len_dist: str | None = None
    micro_batch: int = 32
    steps: int = 4  # timed steps after one warm-up step
    compare: str = ""  # "trl", or "colocate,server" (rl_modes.py)
    device: str = "cuda"  # colocate,server only: "cpu" runs both modes on gloo ranks and a CPU server
    fsdp: bool = False  # colocate mode: the ranks shard with FSDP2 instead of keeping replicas
    gpu_memory_utilization: float | str = "auto"  # the trainer's memory plan sizes the KV cache
    server_gpu_memory_utilization: float = 0.9  # server mode: the server has its GPU to itself
    server_timeout_s: float = 600.0  # for `tandem serve` to load and listen
    cpu_kv_cache_space_gib: float = 1.0  # --device cpu: each engine's KV cache
    sleep_level: int = 2  # GRPOConfig.engine_sleep_level: the trainer brings the weights back
    gradient_checkpointing: bool | None = None  # None: the trainer's memory plan decides
    optim: str = "adamw_torch_fused"  # GRPOConfig.optim: adamw_torch_8bit / _4bit for the largest models
    lora_r: int = 0  # > 0: train a LoRA adapter of this rank on every linear layer (peft), not all weights
    padding_free: bool = False  # tandem's GRPOConfig.padding_free
    share_prompts: bool | None = None  # tandem's GRPOConfig.share_prompts (None: on with padding_free)
    fused_kernels: bool | None = None  # tandem's GRPOConfig.fused_kernels (None: on with CUDA)
    max_tokens_per_micro_batch: int | None = None  # tandem's GRPOConfig field (needs padding_free)
    profile_train: str | None = None  # write one step's train-phase profile table here (rl_profile.py)
    num_scheduler_steps: int | None = None  # tandem's engine: EngineConfig.num_scheduler_steps (None: its default)
    seed: int = 0
    plan_only: bool = False  # print the trainer's memory plan for the workload; load and run nothing
    memory_budget_gib: float | None = None  # the device's capacity for the plan (TANDEM_MEMORY_BUDGET_GIB)
    output: str | None = None
    print_json: bool = False  # end stdout with the report's JSON line


# `--device cpu`: a workload a laptop finishes in a minute or two (grpo-1.5b needs ~50 GB there)
CPU_SIZES = dict(model="smollm2-135m", num_prompts=4, num_generations=2, prompt_len=16,
                 completion_len=16, micro_batch=4, steps=2, cpu_kv_cache_space_gib=0.25)


def float_or_word(text: str) -> float | str:
    """A share, or a word such as "auto"."""
    try:
        return float(text)
    except ValueError:
        return text


def even_token_reward(completions, **kwargs):
    """A cheap, deterministic reward: share of completion tokens with an even id."""
    out = []
    for c in completions:
        words = (c if isinstance(c, str) else c[-1]["content"]).split()
        out.append(sum(int(w[1:]) % 2 == 0 for w in words if w[1:].isdigit()) / max(1, len(words)))
    return out


def hf_config_of(cfg: RLBenchConfig):
    """The architecture: a preset name or a local HF model dir (its weights are not used)."""
    from tandem.models.presets import preset_config

    hf_config = preset_config(cfg.model)
    if hf_config is None and os.path.isfile(os.path.join(cfg.model, "config.json")):
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(cfg.model)  # its architecture; weights stay random
    if hf_config is None:
        raise ValueError(f"model must be an architecture preset name or an HF model dir, got {cfg.model!r}")
    return hf_config


def model_and_data(cfg: RLBenchConfig):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from tandem.models.loader import init_dummy_weights

    hf_config = hf_config_of(cfg)
    # built where it trains: a 7B model's fp32 init takes minutes on the host, a second on a GPU
    device = "cuda" if cfg.device == "cuda" and torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    init_dummy_weights(model, cfg.seed)
    tok = synthetic_tokenizer(hf_config.vocab_size, hf_config.eos_token_id)
    rng = random.Random(cfg.seed)
    n = cfg.num_prompts * (cfg.steps + 2)
    low, high = min(100, hf_config.vocab_size // 4), min(30000, hf_config.vocab_size - 1)
    prompts = [ids_to_text([rng.randint(low, high) for _ in range(cfg.prompt_len)]) for _ in range(n)]
    return model, tok, Dataset.from_dict({"prompt": prompts})


def grpo_kwargs(cfg: RLBenchConfig) -> dict:
    """The GRPOConfig of the colocated tandem run."""
    from tandem.bench.rl_lengths import completion_range

    return dict(output_dir="/tmp/tandem-bench-rl", report_to="none", save_steps=10**9,
                max_prompt_length=cfg.prompt_len, vllm_gpu_memory_utilization=cfg.gpu_memory_utilization,
                engine_sleep_level=cfg.sleep_level, lr_scheduler_type="constant", shuffle_dataset=False,
                use_cpu=cfg.device == "cpu", padding_free=cfg.padding_free, share_prompts=cfg.share_prompts,
                fused_kernels=cfg.fused_kernels,
                max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch,
                **batching(cfg, completion_range(cfg)[1]))


def batching(cfg: RLBenchConfig, max_completion_length: int | None = None) -> dict:
    """The GRPOConfig fields tandem and TRL share; max_completion_length: the longest drawn
    completion (default: completion_len)."""
    per_step = cfg.num_prompts * cfg.num_generations
    return {
        "num_generations": cfg.num_generations, "per_device_train_batch_size": cfg.micro_batch,
        "gradient_accumulation_steps": per_step // cfg.micro_batch,
        "max_completion_length": max_completion_length or cfg.completion_len,
        "learning_rate": 1e-6, "beta": 0.0, "temperature": 1.0,
        "bf16": cfg.device == "cuda" and torch.cuda.is_available(),
        "seed": cfg.seed, "max_steps": cfg.steps + 1, "logging_steps": 1, "optim": cfg.optim,
    } | ({} if cfg.gradient_checkpointing is None else {"gradient_checkpointing": cfg.gradient_checkpointing})
