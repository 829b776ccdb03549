"""The memory plan: its arithmetic against hand-computed sizes, the choices it makes to fit, and
the refusal (before the model loads) of what cannot fit, naming the smallest change that would."""

from dataclasses import replace

import pytest
import torch
from model_fixtures import make_tiny_model

from tandem.rl.activations import ActivationCost, is_recomputing, measure_activations, set_recompute
from tandem.rl.memory_fit import smallest_change
from tandem.rl.memory_plan import (
    GIB,
    Device,
    Workload,
    plan_memory,
)
from tandem.rl.model_sizes import ModelSizes
from tandem.rl.optim import state_bytes, step_temporaries

# A 1 B-parameter model (60 tensors of 2^24), 8 layers: numbers to check by hand.
SIZES = ModelSizes(
    num_params=60 * 2**24,
    trainable_numels=(2**24,) * 60,
    layer_linear_params=9 * 10**8,
    largest_linear=10**8,
    num_layers=8,
    hidden=1024,
    intermediate=4096,
    num_heads=8,
    num_kv_heads=2,
    head_dim=128,
    vocab=32768,
    tied=False,
)
WORK = Workload(
    rows=8,
    row_len=512,
    completion_len=256,
    round_seqs=64,
    bf16=True,
    reference=False,
    peft=False,
    cuda_graphs=False,
)


def device(gib: float, host_gib: float = 1000) -> Device:
    return Device("cuda", int(gib * GIB), int(host_gib * GIB), int(gib * GIB))


def test_full_fine_tune_bytes_by_hand():
    plan = plan_memory(
        SIZES, replace(WORK, gradient_checkpointing=True, optim_offload=False), device(200)
    )
    P = SIZES.num_params
    assert plan.rows["trainer weights"] == (4 * P,) * 3  # fp32 master weights
    assert plan.rows["gradients"] == (None, 4 * P, 4 * P)  # freed by zero_grad before generating
    assert plan.rows["optimizer state"] == (8 * P,) * 3  # AdamW's two fp32 moments
    assert plan.rows["optimizer step temporaries"] == (None, None, 0)  # fused: none
    assert plan.rows["engine weights"] == (2 * P, None, None)  # bf16; sleep level 2 frees them
    block = 2 * 8 * 2 * 128 * 2 * 16  # K and V, layers, kv heads, head dim, bf16, 16 tokens
    assert plan.kv_cache_bytes == (64 * 512 // 16 + 1) * block  # one round at full length
    assert plan.rows["KV cache"] == (plan.kv_cache_bytes, None, None)
    T = 8 * 512
    assert (
        plan.rows["activations"][1] == 8 * 4 * 1024 * T + 8 * 1024 * T + 4 * T
    )  # the layers' fp32 inputs
    gen, train, step = plan.totals()
    assert (
        step == 16 * P and gen == 14 * P + plan.kv_cache_bytes + plan.rows["engine activations"][0]
    )
    awake = plan_memory(
        SIZES, replace(WORK, sleep_level=None, gradient_checkpointing=True), device(200)
    )
    assert (
        awake.rows["engine weights"][1] == 2 * P
        and awake.rows["KV cache"][1] == awake.kv_cache_bytes
    )


def test_optimizer_state_and_temporaries_by_hand():
    big, small = 256 * 64, 100
    assert state_bytes("adamw_torch_fused", [big, small]) == 8 * (big + small)
    assert state_bytes("adamw_torch_8bit", [big, small]) == 2 * (big + 4 * big // 256) + 8 * small
    assert (
        state_bytes("adamw_torch_4bit", [big, small]) == 2 * (big // 2 + 4 * big // 128) + 8 * small
    )
    assert state_bytes("sgd", [big]) == 0 and state_bytes("rmsprop", [big]) == 4 * big
    assert step_temporaries("adamw_torch", [big, small], cuda=True) == 4 * (
        big + small
    )  # foreach sqrt
    assert step_temporaries("adamw_torch_fused", [big, small], cuda=True) == 0
    assert step_temporaries("adamw_torch_fused", [big, small], cuda=False) == 4 * big  # per tensor
    # torchao, a tensor at a time: the largest's fp32 moments, and (4-bit) their int64 codes
    assert step_temporaries("adamw_torch_8bit", [big, small], cuda=True) == 8 * big
    assert step_temporaries("adamw_torch_4bit", [big, small], cuda=True) == 24 * big


def test_the_plan_recomputes_then_offloads_then_shrinks_the_kv_cache():
    roomy = plan_memory(SIZES, WORK, device(200))
    assert not roomy.recompute and not roomy.offload and roomy.fits
    keep, redo = (
        plan_memory(
            SIZES, replace(WORK, gradient_checkpointing=g, optim_offload=False), device(200)
        )
        for g in (False, True)
    )
    mid = (keep.peak + redo.peak) / 2 / GIB / 0.98 + 1 / 0.98  # usable = 98% less 1 GiB
    plan = plan_memory(SIZES, WORK, device(mid))
    assert plan.recompute and not plan.offload and plan.fits and "do not fit" in plan.why[0]
    offloaded = plan_memory(
        SIZES, replace(WORK, gradient_checkpointing=True, optim_offload=True), device(200)
    )
    assert offloaded.rows["optimizer state"] == (0, 0, 0)
    assert offloaded.host_rows["optimizer state (offloaded)"] == 8 * SIZES.num_params
    mid = (redo.peak + offloaded.peak) / 2 / GIB / 0.98 + 1 / 0.98
    plan = plan_memory(SIZES, WORK, device(mid))
    assert plan.offload and plan.fits  # with recompute, or without if the host's room lets it
    assert not plan_memory(SIZES, WORK, device(mid, host_gib=1)).fits  # no host room: no offload
    # a LoRA adapter: the generate phase binds, and the KV cache takes what it leaves
    lora, work = (
        replace(SIZES, trainable_numels=(10**6,)),
        replace(WORK, peft=True, gradient_checkpointing=True),
    )
    full = plan_memory(lora, work, device(200))
    assert (
        full.rows["engine weights"][0] == 2 * (SIZES.num_params - 10**6)
        and full.peak == full.totals()[0]
    )
    tight = plan_memory(
        lora, work, device((full.peak - full.kv_cache_bytes / 2) / GIB / 0.98 + 1 / 0.98)
    )
    assert tight.fits and 0 < tight.kv_cache_bytes < full.kv_cache_bytes
    assert "sequences will wait their turn" in tight.why[2]


def test_what_cannot_fit_names_the_smallest_change():
    work = replace(WORK, optim_offload=False)
    light = plan_memory(
        SIZES, replace(work, optim="adamw_torch_8bit", gradient_checkpointing=True), device(200)
    )
    budget = device(light.peak / GIB / 0.98 + 1 / 0.98 + 0.01)
    assert not plan_memory(SIZES, work, budget).fits
    change, plan = smallest_change(lambda peft: SIZES, work, budget)
    assert change == {"optim_offload": True} and plan.fits  # the same arithmetic, from host memory
    no_host = replace(budget, host=GIB)
    change, plan = smallest_change(lambda peft: SIZES, work, no_host)
    assert change == {"optim": "adamw_torch_8bit"} and plan.fits
    smaller = plan_memory(SIZES, replace(work, gradient_checkpointing=True, rows=4), device(200))
    budget = device(smaller.peak / GIB / 0.98 + 1 / 0.98 + 0.01, host_gib=1)
    change, _ = smallest_change(
        lambda peft: SIZES, replace(work, gradient_checkpointing=True), budget
    )
    assert change == {
        "per_device_train_batch_size": 4
    }  # the same arithmetic, before a lighter optimizer
    assert smallest_change(lambda peft: SIZES, work, device(2)) is None


def test_autocast_weight_copies_are_a_fixed_cost():
    model = make_tiny_model("llama", seed=0)
    cost = measure_activations(model, lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    layer_weights = sum(
        p.numel() for n, p in model.named_parameters() if "layers." in n and "norm" not in n
    )
    assert cost.fixed == pytest.approx(
        2 * layer_weights, rel=0.05
    )  # their bf16 copies, once a forward
    set_recompute(model, True)
    assert is_recomputing(model) and measure_activations(model).per_token < cost.per_token / 4
    assert (
        ActivationCost(10, 5, 2).bytes_for(8, row_len=4) == 5 + 80 + 2 * 2 * 16
    )  # two rows of four


def test_an_awake_plan_replanned_on_less_memory_puts_the_engine_to_sleep():
    """The sleep choice is the plan's, the workload keeps the configured level: the measured
    re-plan (`plan_with_measured_activations` re-plans from `plan.work`) can still pick sleep."""
    auto = replace(WORK, sleep_auto=True, gradient_checkpointing=False, optim_offload=False)
    awake = plan_memory(SIZES, auto, device(200))
    assert awake.fits and awake.sleep_level is None and awake.work.sleep_level == 2
    short = (awake.peak - awake.rows["engine weights"][1] / 2) / GIB  # usable: awake no longer fits
    asleep = plan_memory(SIZES, awake.work, device(short / 0.98 + 1 / 0.98))
    assert asleep.fits and asleep.sleep_level == 2 and asleep.rows["KV cache"][1] is None
