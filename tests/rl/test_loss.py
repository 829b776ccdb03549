"""GRPO loss terms against hand-computed values (torchtune style)."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.rl.config import GRPOConfig
from tandem.rl.logprobs import completion_logps
from tandem.rl.loss import (
    aggregate_loss,
    clipped_surrogate,
    group_advantages,
    grpo_loss,
    importance_weights,
    kl_k3,
    log_importance_ratio,
    loss_kwargs_from_config,
    reward_metrics,
    step_row_scales,
)

E = math.e


def t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def close(x, expected):
    torch.testing.assert_close(x.double(), torch.tensor(expected, dtype=torch.float64))


# ---- clipped surrogate ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "log_ratio, adv, eps_low, eps_high, expected",
    [
        (1.0, 1.0, 0.2, 0.2, -1.2),  # ratio e, clipped at 1.2
        (1.0, 1.0, 0.2, 0.28, -1.28),  # clip-higher: the upper bound moves, not the lower
        (-1.0, 1.0, 0.2, 0.28, -1 / E),  # ratio 1/e, A > 0: min() keeps the unclipped term
        (-1.0, -1.0, 0.2, 0.28, 0.8),  # ratio 1/e, A < 0: clipped at 0.8
        (1.0, -1.0, 0.2, 0.28, E),  # ratio e, A < 0: unclipped (pessimistic bound)
        (0.0, 2.0, 0.2, 0.2, -2.0),  # ratio 1: -A
    ],
)
def test_clipped_surrogate_values(log_ratio, adv, eps_low, eps_high, expected):
    loss, ratio = clipped_surrogate(t([log_ratio]), t(adv), eps_low, eps_high)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert ratio.item() == pytest.approx(math.exp(log_ratio))


def test_clipped_region_has_no_gradient_and_unclipped_has_ratio_times_advantage():
    lr = torch.tensor([[1.0, 1.0]], dtype=torch.float64, requires_grad=True)
    loss, _ = clipped_surrogate(lr, t(1.0), 0.2, 0.2)  # both clipped (ratio e, A = 1)
    loss.sum().backward()
    assert lr.grad.tolist() == [[0.0, 0.0]]
    lr = torch.tensor([[1.0]], dtype=torch.float64, requires_grad=True)
    loss, _ = clipped_surrogate(lr, t(-1.0), 0.2, 0.2)  # unclipped: d(-r A)/d log r = -r A = e
    loss.sum().backward()
    assert lr.grad.item() == pytest.approx(E)


def test_sequence_level_ratio_is_the_masked_length_mean():
    logp = t([-1.0, -2.0, -9.0])
    old = t([-2.0, -2.5, 0.0])
    mask = t([1.0, 1.0, 0.0])
    assert log_importance_ratio(logp, old, mask, "sequence").tolist() == [[0.75]]  # (1 + 0.5) / 2
    assert log_importance_ratio(logp, old, mask, "token").shape == (1, 3)


# ---- KL ---------------------------------------------------------------------------------------


def test_kl_k3_values():
    logp = t([0.0, math.log(0.5), -1.0])
    ref = t([math.log(0.5), math.log(0.5), 0.0])
    kl = kl_k3(logp, ref)
    assert kl[0, 0].item() == pytest.approx(0.5 + math.log(2) - 1)  # d = -log 2
    assert kl[0, 1].item() == 0.0  # equal policies
    assert kl[0, 2].item() == pytest.approx(E - 1 - 1)  # d = 1: e - 1 - 1
    assert (
        kl_k3(torch.randn(50, dtype=torch.float64), torch.randn(50, dtype=torch.float64)) >= 0
    ).all()


# ---- advantages -------------------------------------------------------------------------------


def test_group_advantages_scale_modes():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    std = math.sqrt(1 / 3)  # Bessel: 4 * 0.25 / 3
    adv = group_advantages(r, 4, "group")
    expected = [0.5, -0.5, -0.5, 0.5]
    assert adv[:4].tolist() == pytest.approx([e / (std + 1e-4) for e in expected], rel=1e-6)
    assert adv[4:].tolist() == [0.0] * 4  # no spread: no signal
    assert group_advantages(r, 4, "none").tolist() == pytest.approx(expected + [0.0] * 4)
    batch_std = torch.std(r).item()
    assert group_advantages(r, 4, "batch").tolist() == pytest.approx(
        [e / (batch_std + 1e-4) for e in expected + [0.0] * 4], rel=1e-6
    )


def test_group_advantages_leave_unscorable_out():
    r = torch.tensor([1.0, float("nan"), 0.0, 2.0])
    adv = group_advantages(r, 4, "none")  # mean of {1, 0, 2} = 1
    assert adv.tolist() == pytest.approx([0.0, 0.0, -1.0, 1.0])
    assert group_advantages(torch.full((4,), float("nan")), 2, "group").tolist() == [0.0] * 4


def test_group_advantages_rejects_partial_groups():
    with pytest.raises(ValueError, match="divisible by num_generations"):
        group_advantages(torch.zeros(6), 4)


def test_reward_metrics():
    m = reward_metrics(torch.tensor([1.0, 0.0, 2.0, 2.0]), 2)
    assert m["reward"] == pytest.approx(1.25)
    assert m["frac_reward_zero_std"] == 0.5


# ---- importance sampling correction -----------------------------------------------------------


def test_importance_weights_token_modes():
    old = t([math.log(4.0), math.log(0.5), 0.0])
    engine = t([0.0, 0.0, 5.0])  # third token is padding
    mask = t([1.0, 1.0, 0.0])
    w = importance_weights(old, engine, mask, "token_truncate", clip_max=3.0)
    close(w, [[3.0, 0.5, 1.0]])
    w = importance_weights(old, engine, mask, "token_mask", clip_max=3.0)
    close(w, [[0.0, 0.5, 1.0]])
    w = importance_weights(old, engine, mask, "token_mask", clip_max=None, clip_min=0.6)
    close(w, [[4.0, 0.0, 1.0]])
    w = importance_weights(old, engine, mask, "token_truncate", clip_max=3.0, clip_min=0.6)
    close(w, [[3.0, 0.6, 1.0]])


def test_importance_weights_sequence_modes():
    old = t([math.log(4.0), math.log(0.5), 0.0], [math.log(2.0), math.log(2.0), 0.0])
    engine = torch.zeros_like(old)
    mask = t([1.0, 1.0, 0.0], [1.0, 1.0, 1.0])
    # sequence ratios: 4 * 0.5 = 2 (padding ignored); 2 * 2 * 1 = 4
    w = importance_weights(old, engine, mask, "sequence_truncate", clip_max=3.0)
    close(w, [[2.0], [3.0]])
    w = importance_weights(old, engine, mask, "sequence_mask", clip_max=3.0)
    close(w, [[2.0], [0.0]])


def test_importance_weights_rejects_unknown_mode():
    with pytest.raises(ValueError, match="token_truncate"):
        importance_weights(t(0.0), t(0.0), t(1.0), "token_clip")


# ---- aggregation ------------------------------------------------------------------------------

LOSS = t([1.0, 2.0, 3.0, 7.0], [4.0, 9.0, 9.0, 9.0])  # padding positions hold junk
MASK = t([1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0])


@pytest.mark.parametrize(
    "loss_type, kwargs, expected",
    [
        ("grpo", {}, (6 / 3 + 4 / 1) / 2),  # per-sequence mean, then mean: 3.0
        ("bnpo", {}, 10 / 4),  # all tokens / local tokens
        ("dr_grpo", {"max_completion_length": 4}, 10 / (2 * 4)),
        ("dapo", {"num_items_in_batch": 8}, 10 / 8),  # global token count
        ("dapo", {}, 10 / 4),  # no global count: local, as bnpo
        ("grpo", {"num_micro_batches": 2}, 3.0 / 2),
        ("dapo", {"num_items_in_batch": 8, "num_micro_batches": 2}, 10 / 8),  # already global
    ],
)
def test_aggregate_loss(loss_type, kwargs, expected):
    assert aggregate_loss(LOSS, MASK, loss_type, **kwargs).item() == pytest.approx(expected)


def test_dapo_over_micro_batches_equals_one_big_batch_token_mean():
    torch.manual_seed(0)
    loss = torch.randn(6, 5, dtype=torch.float64)
    mask = (torch.rand(6, 5) > 0.3).double()
    n = mask.sum()
    split = sum(
        aggregate_loss(loss[i : i + 2], mask[i : i + 2], "dapo", num_items_in_batch=n)
        for i in range(0, 6, 2)
    )
    assert split.item() == pytest.approx(aggregate_loss(loss, mask, "bnpo").item())


def test_step_row_scales_hand_computed():
    mask = torch.tensor([[1.0, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]])  # 2, 1, 3, 0 tokens
    micro = [slice(0, 2), slice(2, 4)]  # two micro-batches of 2 rows; on 2 processes: 4 in all
    cases = {
        "grpo": [1 / (2 * 2 * 4), 1 / (1 * 2 * 4), 1 / (3 * 2 * 4), 1 / (1 * 2 * 4)],  # 1 / (len B M)
        "bnpo": [1 / (3 * 4)] * 2 + [1 / (3 * 4)] * 2,  # 1 / (the micro-batch's tokens x M)
        "dr_grpo": [1 / (2 * 3 * 4)] * 4,  # 1 / (B x max_completion_length x M)
        "dapo": [1 / 12] * 4,  # 1 / the whole step's tokens, every process's
    }
    for loss_type, expected in cases.items():
        got = step_row_scales(mask, loss_type, micro, max_completion_length=3, num_items_in_batch=12,
                              num_micro_batches=4)
        torch.testing.assert_close(got, torch.tensor(expected), msg=loss_type)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_row_scales_give_the_micro_batch_losses_whatever_the_grouping(loss_type):
    torch.manual_seed(1)
    loss = torch.randn(6, 5, dtype=torch.float64)
    mask = (torch.rand(6, 5) > 0.4).double()
    micro = [slice(0, 3), slice(3, 6)]
    fixed = sum(aggregate_loss(loss[s], mask[s], loss_type, 5, mask.sum(), 2) for s in micro)
    scale = step_row_scales(mask, loss_type, micro, 5, mask.sum()).double()
    regrouped = [torch.tensor([0, 4]), torch.tensor([1, 2, 3, 5])]  # other rows together
    total = sum(aggregate_loss(loss[r], mask[r], loss_type, row_scale=scale[r]) for r in regrouped)
    assert total.item() == pytest.approx(fixed.item(), rel=1e-12)


def test_sequence_level_loss_broadcasts_over_tokens():
    seq_loss = t([2.0], [4.0])
    assert aggregate_loss(seq_loss, MASK, "grpo").item() == pytest.approx(3.0)
    assert aggregate_loss(seq_loss, MASK, "bnpo").item() == pytest.approx((2 * 3 + 4) / 4)


def test_aggregate_loss_errors():
    with pytest.raises(ValueError, match="loss_type"):
        aggregate_loss(LOSS, MASK, "ppo")
    with pytest.raises(ValueError, match="max_completion_length"):
        aggregate_loss(LOSS, MASK, "dr_grpo")


# ---- the composed loss ------------------------------------------------------------------------


def test_grpo_loss_on_policy_is_the_policy_gradient():
    logp = t([-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]).requires_grad_(True)
    adv = t(1.0, -2.0)
    mask = t([1.0, 1.0, 0.0], [1.0, 1.0, 1.0])
    loss, metrics = grpo_loss(logp, None, adv, mask, loss_type="dapo", num_items_in_batch=5)
    assert loss.item() == pytest.approx((-1.0 * 2 + 2.0 * 3) / 5)
    loss.backward()
    close(logp.grad, [[-0.2, -0.2, 0.0], [0.4, 0.4, 0.4]])
    assert metrics["clip_ratio/region_mean"].item() == 0.0
    assert "kl" not in metrics


def test_grpo_loss_adds_kl_and_reports_clipping():
    logp = t([0.0, 0.0])
    old = t([-1.0, 0.0])  # ratios e and 1
    ref = t([math.log(0.5), 0.0])
    loss, m = grpo_loss(logp, old, t(1.0), t([1.0, 1.0]), loss_type="bnpo", beta=0.1, ref_logp=ref)
    kl0 = 0.5 + math.log(2) - 1
    assert loss.item() == pytest.approx(((-1.2 + 0.1 * kl0) + (-1.0)) / 2)
    assert m["kl"].item() == pytest.approx(kl0 / 2)
    assert m["clip_ratio/high_mean"].item() == pytest.approx(0.5)
    assert m["clip_ratio/low_mean"].item() == 0.0
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(logp, old, t(1.0), t([1.0, 1.0]), beta=0.1)


def test_grpo_loss_applies_importance_weights_from_the_engine():
    logp = t([0.0, 0.0])
    engine = t([-math.log(2.0), 0.0])  # token ratios 2 and 1
    loss, m = grpo_loss(
        logp,
        None,
        t(1.0),
        t([1.0, 1.0]),
        loss_type="bnpo",
        engine_logp=engine,
        is_mode="token_truncate",
        is_clip_max=3.0,
    )
    assert loss.item() == pytest.approx((-2.0 - 1.0) / 2)
    assert m["sampling/importance_sampling_ratio/max"].item() == pytest.approx(2.0)
    assert m["sampling/importance_sampling_ratio/min"].item() == pytest.approx(1.0)
    assert m["sampling/sampling_logp_difference/max"].item() == pytest.approx(math.log(2.0))
    loss, _ = grpo_loss(
        logp,
        None,
        t(1.0),
        t([1.0, 1.0]),
        loss_type="bnpo",
        engine_logp=engine,
        is_mode="sequence_mask",
        is_clip_max=1.5,
    )  # sequence ratio 2 > 1.5
    assert loss.item() == 0.0


def test_loss_kwargs_from_config():
    kw = loss_kwargs_from_config(GRPOConfig(epsilon_high=0.28, loss_type="dr_grpo"))
    assert kw["epsilon_low"] == 0.2 and kw["epsilon_high"] == 0.28
    assert kw["loss_type"] == "dr_grpo" and kw["max_completion_length"] == 256


def test_grpo_steps_raise_the_rewarded_completion(tiny_model):
    """The pieces composed as a trainer calls them: rewards -> advantages -> loss -> step."""
    torch.manual_seed(0)
    prompt = torch.randint(0, 128, (4,))
    comps = torch.randint(0, 128, (4, 3))  # one prompt, G = 4 completions
    ids = torch.cat([prompt.expand(4, -1), comps], dim=1)
    attn = torch.ones_like(ids)
    mask = torch.ones(4, 3)
    plen = torch.full((4,), 4)
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), num_generations=4)
    opt = torch.optim.SGD(tiny_model.parameters(), lr=0.5)
    kwargs = loss_kwargs_from_config(GRPOConfig(max_completion_length=3))
    with torch.no_grad():
        before = completion_logps(tiny_model, ids, attn, plen, 3).sum(-1)
    for _ in range(3):
        logp = completion_logps(tiny_model, ids, attn, plen, 3)
        loss, _ = grpo_loss(logp, None, adv, mask, **kwargs)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = completion_logps(tiny_model, ids, attn, plen, 3).sum(-1)
    gain = after - before
    assert gain[0] > 0 and (gain[0] > gain[1:]).all()
