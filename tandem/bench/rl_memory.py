"""`tandem bench rl`'s memory side: the trainer's memory plan for the workload, made from the
architecture's config before anything loads (`--plan-only` stops there: nothing is allocated), and
the measured peaks per phase printed beside it after the run."""

from __future__ import annotations

import json
import os

import torch

from tandem.bench.rl_workload import RLBenchConfig, grpo_kwargs, hf_config_of
from tandem.rl.memory_plan import BUDGET_ENV, GIB, MemoryPlan

ENGINE_KWARGS = {"max_num_seqs": 256}  # what run_tandem gives the colocated engine


def peft_config_of(cfg: RLBenchConfig):
    if not cfg.lora_r:
        return None
    from peft import LoraConfig

    return LoraConfig(r=cfg.lora_r, lora_alpha=2 * cfg.lora_r, target_modules="all-linear")


def plan_for(cfg: RLBenchConfig) -> MemoryPlan:
    """The plan the trainer will make for this workload, from the config alone; a MemoryPlanError
    (a ValueError naming the smallest change that fits) when it does not fit. Without a GPU here,
    a GPU run is planned on TANDEM_MEMORY_BUDGET_GIB (`--memory-budget-gib`)."""
    from tandem.rl import GRPOConfig
    from tandem.rl.memory_setup import plan_before_loading

    cuda = cfg.device == "cuda"
    if cuda and not torch.cuda.is_available() and not os.environ.get(BUDGET_ENV):
        raise ValueError(
            "--plan-only without a GPU here plans a GPU run on a stated budget: give "
            "--memory-budget-gib (139.8 for an H200, 79.1 for an 80 GB H100)"
        )
    kwargs = grpo_kwargs(cfg)
    kwargs["bf16"] = cuda  # as run_tandem will run it on the GPU
    args = GRPOConfig(**kwargs)
    world = 1  # the colocated trainer of run_tandem: one process
    return plan_before_loading(
        hf_config_of(cfg),
        args,
        peft_config_of(cfg),
        dict(ENGINE_KWARGS),
        torch.device("cuda" if cuda else "cpu"),
        cuda,
        world,
    )


def plan_only(cfg: RLBenchConfig) -> dict:
    """Print the plan (or why it does not fit) and one line of JSON; load and run nothing."""
    from tandem.rl.memory_plan import MemoryPlanError

    try:
        plan = plan_for(cfg)
    except MemoryPlanError as e:
        print(str(e))
        out = summary(e.plan) | {"error": str(e).split("\n")[0]}
    else:
        print(plan.format(f"memory plan ({cfg.model})"))
        out = summary(plan)
    print(json.dumps(out))
    return out


def summary(plan: MemoryPlan) -> dict:
    gen, train, step = plan.totals()
    return {
        "fits": plan.fits,
        "peak_gib": plan.peak / GIB,
        "usable_gib": plan.device.usable / GIB,
        "plan_generate_gib": gen / GIB,
        "plan_train_gib": train / GIB,
        "plan_optimizer_step_gib": step / GIB,
        "recompute": plan.recompute,
        "optim": plan.optim,
        "optim_offload": plan.offload,
        "kv_cache_gib": plan.kv_cache_bytes / GIB,
        "params": plan.sizes.num_params,
        "trainable": plan.sizes.num_trainable,
        "host_gib": plan.host_total / GIB,
    }
