"""The memory plan applied to a GRPOTrainer, in the order of its construction: planned from the
config before the model loads (refused there if nothing fits), the engine's KV cache and the
optimizer's placement taken from it, then the activations measured on the model as it will train
and the recompute choice made from them, printed before the first step."""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace

import torch

from tandem.rl.activations import measure_activations, set_recompute
from tandem.rl.memory_fit import refusal, smallest_change
from tandem.rl.memory_plan import (
    MemoryPlan,
    MemoryPlanError,
    Workload,
    device_of,
    plan_memory,
)
from tandem.rl.model_sizes import ModelSizes, model_sizes, sizes_of_model

# engine kwargs that size the KV cache: given by the caller, the plan's "auto" size stands aside
KV_SIZING = (
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
    "num_gpu_blocks_override",
    "cpu_kv_cache_space_gib",
)


ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


def expandable_segments(device: torch.device) -> str | None:
    """Torch's allocator in expandable segments from here on (CUDA; unless the user configured it
    through PYTORCH_CUDA_ALLOC_CONF): the train phase frees and reallocates tens of GiB of
    differently sized blocks a step, and fixed segments left a 7B run 11.5 GiB reserved but
    unusable at its first optimizer step. The engine maps its own memory outside the allocator,
    so sleep and wake are unaffected. Returns the line that says so, or None."""
    if device.type != "cuda" or "expandable_segments" in os.environ.get(ALLOC_CONF, ""):
        return None
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    return f"memory: torch's allocator uses expandable segments ({ALLOC_CONF} to choose otherwise)"


def sizes_for(model, peft_config=None, trust_remote_code: bool = False) -> ModelSizes:
    """An in-memory model's own sizes, or its config's on the meta device (with a LoRA adapter:
    always, the adapter applied there). `model`: a local dir, an HF config, or a model."""
    if isinstance(model, torch.nn.Module) and peft_config is None:
        return sizes_of_model(model)
    if isinstance(model, torch.nn.Module):
        return model_sizes(model.config, peft_config)
    if not isinstance(model, str):  # a transformers config
        return model_sizes(model, peft_config)
    from transformers import AutoConfig

    return model_sizes(
        AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code), peft_config
    )


def plan_before_loading(
    model,
    args,
    peft_config,
    engine: dict,
    device: torch.device,
    bf16: bool,
    shards: int,
    trust_remote_code: bool = False,
) -> MemoryPlan:
    """The plan from the config alone (`model`: a local dir or an in-memory model); a
    MemoryPlanError naming the smallest change that fits if nothing does."""
    peft = peft_config is not None
    sizes = sizes_for(model, peft_config, trust_remote_code)
    work = Workload.from_config(args, bf16, peft, engine, shards)
    resident = 0
    if isinstance(
        model, torch.nn.Module
    ):  # already on the device: its bytes are not free, but ours
        resident = sum(
            p.numel() * p.element_size()
            for p in model.parameters()
            if p.device.type == device.type == "cuda"
        )
    plan = plan_memory(sizes, work, device_of(device, resident))
    if not plan.fits:

        def sizes_with(lora: bool) -> ModelSizes:
            if lora == peft:
                return sizes
            from peft import LoraConfig

            return sizes_for(
                model,
                LoraConfig(r=16, target_modules="all-linear") if lora else None,
                trust_remote_code,
            )

        change = smallest_change(sizes_with, work, plan.device)
        raise MemoryPlanError(
            refusal(plan, change) + "\n" + plan.format("the plan that does not fit"), plan
        )
    return plan


def engine_kv_kwargs(plan: MemoryPlan | None, args, engine_kwargs: dict) -> dict:
    """What the engine is told about its KV cache: the plan's size under "auto", unless the caller
    sized it; a share otherwise."""
    if any(k in engine_kwargs for k in KV_SIZING):
        return {}
    if args.vllm_gpu_memory_utilization != "auto":
        return {"gpu_memory_utilization": args.vllm_gpu_memory_utilization}
    return {"kv_cache_memory_bytes": max(1, plan.kv_cache_bytes)} if plan is not None else {}


def plan_with_measured_activations(
    plan: MemoryPlan, model: torch.nn.Module, bf16: bool, sharded: bool
) -> MemoryPlan:
    """The plan again with the activations the model really saves (probed, as the trainer will
    run it) and the KV cache and optimizer placement already fixed; switches recompute on the
    model as it chooses. FSDP shards are not probed (their root is gathered only inside the
    model's own forward): they recompute unless told not to."""
    w = plan.work
    fixed = replace(w, kv_bytes=plan.kv_cache_bytes, kv_blocks=None, optim_offload=plan.offload)
    if sharded:
        if w.gradient_checkpointing is None:
            fixed = replace(fixed, gradient_checkpointing=True)
        final = plan_memory(plan.sizes, fixed, plan.device)
    else:
        device = next(model.parameters()).device
        precision = (
            (lambda: torch.autocast(device.type, dtype=torch.bfloat16))
            if bf16
            else contextlib.nullcontext
        )
        set_recompute(model, False)
        keep = measure_activations(model, precision)
        set_recompute(model, True)
        redo = measure_activations(model, precision)
        final = plan_memory(plan.sizes, fixed, plan.device, activations=(keep, redo))
    optimizer_line = next(
        r for r in plan.why if r.startswith("optimizer ")
    )  # why, as first planned
    final.why = [optimizer_line if r.startswith("optimizer ") else r for r in final.why]
    if not final.fits:
        raise MemoryPlanError(
            "measured on the model, the training phase does not fit: "
            + refusal(final, None, "the training phase")
            + "\n"
            + final.format("the measured plan"),
            final,
        )
    set_recompute(model, final.recompute)
    return final
