"""When a plan does not fit: the least change of the user's own choices that would (a smaller
micro-batch, a lighter optimizer, LoRA), and the refusal's words."""

from __future__ import annotations

from dataclasses import replace

from tandem.rl import optim as optim_mod
from tandem.rl.memory_plan import BUDGET_ENV, GIB, Device, MemoryPlan, Workload, plan_memory, size


def smallest_change(sizes_for, work: Workload, device: Device) -> tuple[dict, MemoryPlan] | None:
    """The least change of the user's own choices that fits: a smaller micro-batch (the same
    global batch, more accumulation), then a lighter optimizer (8-bit, 4-bit AdamW), then both,
    then a LoRA adapter; (GRPOConfig overrides, the plan) or None. `sizes_for(peft)`: the sizes
    with or without a LoRA adapter."""
    rows = [work.rows]
    while rows[-1] > 1:
        rows.append(rows[-1] // 2)
    optims = [work.optim] + [
        o for o in ("adamw_torch_8bit", "adamw_torch_4bit") if work.optim in optim_mod.ADAMW_32BIT
    ]
    opened = dict(
        gradient_checkpointing=None
        if work.gradient_checkpointing is False
        else work.gradient_checkpointing,
        optim_offload=None if work.optim_offload is False else work.optim_offload,
        kv="auto" if work.colocated else work.kv,
    )
    sizes = sizes_for(work.peft)
    for opt in optims:
        for r in rows:
            trial = replace(work, rows=r, optim=opt, **opened)
            plan = plan_memory(sizes, trial, device)
            if plan.fits:
                return _overrides(work, trial, plan), plan
    if not work.peft and work.shards == 1:
        trial = replace(work, peft=True, reference=False, **opened)
        plan = plan_memory(sizes_for(True), trial, device)
        if plan.fits:
            return {
                "peft_config": "LoraConfig(r=16, target_modules='all-linear')",
                **_overrides(work, trial, plan),
            }, plan
    return None


def _overrides(work: Workload, trial: Workload, plan: MemoryPlan) -> dict:
    out = {}
    if trial.rows != work.rows:
        out["per_device_train_batch_size"] = trial.rows
    if trial.optim != work.optim:
        out["optim"] = trial.optim
    if work.gradient_checkpointing is False and plan.recompute:
        out["gradient_checkpointing"] = True
    if work.optim_offload is False and plan.offload:
        out["optim_offload"] = True
    if work.kv != "auto" and trial.kv == "auto":
        out["vllm_gpu_memory_utilization"] = "auto"
    return out


def refusal(
    plan: MemoryPlan, change: tuple[dict, MemoryPlan] | None, what: str = "this run"
) -> str:
    """The message of a plan that does not fit: what it needs, what the device has, what would fit."""
    d = plan.device
    src = f"from {BUDGET_ENV}" if d.budget_from_env else "free when the trainer started"
    msg = [
        f"{what} does not fit on the {d.type} device: the plan's peak is {size(plan.peak)} but "
        f"{size(d.usable)} are usable ({size(d.capacity)} {src}, less what a process and the "
        "allocator keep)"
    ]
    if plan.host_total > d.host:
        msg.append(f"host memory: {size(plan.host_total)} needed, {size(d.host)} available")
    if not plan.kv_ok:
        msg.append(
            f"the KV cache ({size(plan.kv_cache_bytes)}) cannot hold one sequence of "
            f"{plan.work.engine_len or plan.work.row_len} tokens"
        )
    if change is None:
        msg.append(
            "nothing tried fits (a smaller micro-batch, an 8-bit or 4-bit AdamW, LoRA): "
            "shard the model over more GPUs (fsdp=True under torchrun) or take a smaller one"
        )
    else:
        overrides, fitting = change
        parts = ", ".join(
            f"{k}={v!r}" if k != "peft_config" else f"{k}={v}" for k, v in overrides.items()
        )
        keep = (
            " (with gradient_accumulation_steps / steps_per_generation raised to keep the batch)"
            if "per_device_train_batch_size" in overrides
            else ""
        )
        msg.append(f"smallest change that fits: {parts}{keep}, peak {fitting.peak / GIB:.2f} GiB")
    return "; ".join(msg)
