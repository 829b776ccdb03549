"""The training memory plan: measured activation costs, and the recompute choice they lead to."""

import pytest
import torch
from model_fixtures import make_tiny_model

from tandem.rl.memory_plan import (
    GIB,
    ActivationCost,
    TrainMemoryPlan,
    head_workspace_bytes,
    is_recomputing,
    measure_activations,
    set_recompute,
)


def test_activation_cost_is_what_backward_saves_at_any_length():
    model = make_tiny_model("llama", seed=0)
    cost = measure_activations(model, lengths=(16, 48))
    check = measure_activations(model, lengths=(80, 160))  # a line: the same slope and intercept
    assert cost.per_token == pytest.approx(check.per_token, rel=1e-6)
    assert cost.bytes_for(160) == pytest.approx(check.bytes_for(160), rel=1e-6)
    # at least the fp32 residual stream of every layer is saved per token
    h, layers = model.config.hidden_size, model.config.num_hidden_layers
    assert cost.per_token >= 4 * h * layers


def test_recompute_saves_the_layer_inputs_only():
    model = make_tiny_model("llama", seed=0)
    keep = measure_activations(model)
    set_recompute(model, True)
    redo = measure_activations(model)
    assert redo.per_token < keep.per_token / 4


def test_autocast_weight_copies_are_a_fixed_cost():
    model = make_tiny_model("llama", seed=0)
    cost = measure_activations(model, lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    layer_weights = sum(p.numel() for n, p in model.named_parameters() if "layers." in n and "norm" not in n)
    assert cost.fixed == pytest.approx(2 * layer_weights, rel=0.05)  # their bf16 copies, once a forward


def plan(free_gib, keep=1e5, redo=1e4):
    return TrainMemoryPlan(tokens_per_micro_batch=10_000, keep=ActivationCost(keep, 0),
                           recompute=ActivationCost(redo, 0), num_layers=10,
                           head_workspace=head_workspace_bytes(1000, 100), free=int(free_gib * GIB))


def test_the_plan_recomputes_only_when_keeping_does_not_fit():
    assert plan(10).need(False) == 10_000 * 1e5 + 12 * 1000 * 100
    assert plan(10).need(True) == int(10_000 * 1e4 + 10_000 * 9e4 / 10 + 12 * 1000 * 100)
    assert plan(10).choose_recompute()[0] is False
    recompute, why = plan(0.5).choose_recompute()
    assert recompute and "with recompute" in why
    with pytest.raises(ValueError, match="per_device_train_batch_size"):
        plan(0.01).choose_recompute()
    assert "activations, kept" in plan(1).format()
    squeezed = plan(10)
    squeezed.gradients = squeezed.optimizer_state = int(4.2 * GIB)  # what the first step allocates counts
    assert squeezed.choose_recompute()[0] is True
    assert squeezed.peak(True) == 2 * int(4.2 * GIB) + squeezed.need(True)


def test_a_tight_budget_makes_the_trainer_recompute_with_the_same_result(tmp_path, monkeypatch):
    """gradient_checkpointing=None: the plan decides at the first training phase; squeezed, it
    chooses recompute, and the step is the unconstrained one (fp32, tiny model)."""
    from tandem.rl import memory_plan as plan_mod
    from tests.rl.test_trainer import make_trainer

    roomy = make_trainer(tmp_path / "a", max_steps=1, gradient_checkpointing=None)
    want = roomy.step()
    assert roomy.update.recompute is False and "no recompute" in roomy.update.memory_plan.choose_recompute()[1]
    plan = roomy.update.memory_plan
    budget = (plan.need(True) + plan.need(False)) // 2  # fits only with recompute
    free = (budget + plan.gradients + plan.optimizer_state) / plan.margin
    assert plan.gradients == sum(p.numel() * 4 for p in roomy.model.parameters())  # fp32, all trainable
    monkeypatch.setattr(plan_mod, "free_memory", lambda device: int(free))
    tight = make_trainer(tmp_path / "b", max_steps=1, gradient_checkpointing=None)
    got = tight.step()
    assert tight.update.recompute is True and is_recomputing(tight.model)
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-6)
    for (n, a), b in zip(roomy.model.named_parameters(), tight.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=n)
    monkeypatch.setattr(plan_mod, "free_memory", lambda device: 1)
    with pytest.raises(ValueError, match="even with gradient checkpointing"):
        make_trainer(tmp_path / "c", max_steps=1, gradient_checkpointing=None).step()
