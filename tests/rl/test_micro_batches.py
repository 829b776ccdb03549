"""Micro-batches by token budget: the balanced split by hand, and the invariance that makes it safe:
per-token logprobs, the loss and every gradient equal those of fixed, padded micro-batches (fp32)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from model_fixtures import make_tiny_model

from tandem.rl.config import GRPOConfig
from tandem.rl.distributed import DistributedContext
from tandem.rl.logprobs import completion_logps
from tandem.rl.memory_setup import plan_before_loading
from tandem.rl.micro_batches import balanced_bins, describe, fixed_steps, split_rows, token_budget_bins
from tandem.rl.rollout import Rollout, pack
from tandem.rl.strategy import make_strategy
from tandem.rl.update import PolicyUpdate

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]


def test_balanced_bins_longest_first_into_the_least_filled():
    # 9 -> a, 7 -> b, 5 -> b (12), 4 -> a (13), 3 -> b (15), 2 -> a (15)
    assert balanced_bins([9, 7, 5, 4, 3, 2], 2) == [[0, 3, 5], [1, 2, 4]]
    # ties go to the lower bin: 9, 7, 5 one each; 4 -> the 5 (9); 3 -> the 7 (10); 2 -> the first 9
    assert balanced_bins([9, 7, 5, 4, 3, 2], 3) == [[0, 5], [1, 4], [2, 3]]


def test_token_budget_bins_use_as_few_as_fit():
    assert token_budget_bins([9, 7, 5, 4, 3, 2], 15) == [[0, 3, 5], [1, 2, 4]]  # 30 / 15: 2, full
    assert len(token_budget_bins([9, 7, 5, 4, 3, 2], 14)) == 3
    assert token_budget_bins([6, 6, 6], 9) == [[0], [1], [2]]  # 2 bins would hold 12 > 9: one more
    assert token_budget_bins([3, 3], 100) == [[0, 1]]


def test_ranks_agree_on_the_number_of_micro_batches():
    # another rank needs 3: this one runs 3 too (FSDP gathers once per forward pass on every rank)
    other = iter([9, 3, 0])  # its longest row, its micro-batch count, whether one overflowed
    assert len(token_budget_bins([4, 4, 4, 4], 16, agree=lambda v: max(v, next(other)))) == 3
    other = iter([20, 1, 0])  # its row of 20 tokens stops every rank
    with pytest.raises(ValueError, match="sequence of 20 tokens"):
        token_budget_bins([4, 4], 16, agree=lambda v: max(v, next(other)))


def test_a_sequence_longer_than_the_budget_is_an_error_naming_the_field():
    with pytest.raises(ValueError, match=r"sequence of 20 tokens .* max_tokens_per_micro_batch \(16\)"):
        token_budget_bins([5, 20, 3], 16)


def test_split_rows_keeps_each_step_whole_and_every_micro_batch_in_budget():
    lengths = [9, 2, 7, 3, 5, 5, 8, 1, 4, 6, 2, 2]
    mask = torch.zeros(12, 9, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    fixed = split_rows(mask, 3, 2)  # 2 micro-batches of 3 rows a step
    assert fixed.order is None and fixed.steps == fixed_steps(12, 3, 2)
    assert fixed.steps == [[slice(0, 3), slice(3, 6)], [slice(6, 9), slice(9, 12)]]
    split = split_rows(mask, 3, 2, budget=12)
    order = split.order.tolist()
    assert sorted(order) == list(range(12))
    assert sorted(order[:6]) == list(range(6)) and sorted(order[6:]) == list(range(6, 12))  # steps whole
    for step in split.steps:
        for s in step:
            assert sum(lengths[i] for i in order[s]) <= 12
    assert split.tokens == [sum(lengths[i] for i in order[s]) for step in split.steps for s in step]
    assert [len(step) for step in split.steps] == [3, 2]  # 31 tokens, then 23: a step's count varies


def test_shared_prompt_micro_batches_bin_whole_groups_and_count_each_prompt_once():
    # 3 groups: prompt 4 + completions 3, 5, 2 (14 packed); prompt 2 + 6, 6 (14); prompt 3 + 9 (12)
    plens = torch.tensor([4, 4, 4, 2, 2, 3])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    lengths = plens + torch.tensor([3, 5, 2, 6, 6, 9])
    mask = (torch.arange(12)[None] < lengths[:, None]).long()
    fixed = split_rows(mask, 3, 2, prompts=(plens, groups))
    assert fixed.tokens == [14, 2 + 12 + 3 + 9]
    split = split_rows(mask, 6, 1, budget=16, prompts=(plens, groups))
    assert split.tokens == [14, 14, 12]  # each group whole in a micro-batch of its own
    assert [sorted(split.order[s].tolist()) for s in split.steps[0]] in ([[0, 1, 2], [3, 4], [5]],
                                                                         [[3, 4], [0, 1, 2], [5]])
    cut = split_rows(mask, 6, 1, budget=12, prompts=(plens, groups))  # groups 0 and 1 cut in two
    assert all(t <= 12 for t in cut.tokens) and sum(cut.tokens) == 14 + 14 + 12 + 4 + 2
    with pytest.raises(ValueError, match="sequence of 12 tokens"):
        split_rows(mask, 6, 1, budget=11, prompts=(plens, groups))


def test_the_run_says_how_rows_become_micro_batches():
    def line(**kw):
        return describe(GRPOConfig(output_dir=None, report_to="none", per_device_train_batch_size=8,
                                   num_generations=4, **kw))

    assert line() == ("micro-batches: padded rows, of 8 rows (padding_free=True packs them: no FLOP on "
                      "padding, and each prompt once with its completions)")
    assert line(padding_free=True) == "micro-batches: padding-free, of 8 rows, each prompt packed once with its completions"
    assert line(padding_free=True, share_prompts=False, max_tokens_per_micro_batch=4096) == (
        "micro-batches: padding-free, of at most 4,096 tokens, each row with its own prompt (share_prompts=False)")


# ---- invariance: the training phase itself --------------------------------------------------------


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps each step's gradients, as they were applied."""

    def __init__(self, params, lr):
        self.params_list = list(params)
        super().__init__(self.params_list, lr=lr)
        self.grads: list[list[torch.Tensor]] = []

    def step(self, closure=None):
        self.grads.append([p.grad.clone() for p in self.params_list])
        return super().step(closure)


def _rollout(seed: int = 0, n: int = 16, group: int = 1) -> Rollout:
    """n rows of random prompts (`group` rows to each) and completions of 1-12 tokens."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 300, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n // group) for _ in [0]]
    prompts = [p for p in prompts for _ in range(group)]
    completions = [torch.randint(3, 300, (int(torch.randint(1, 13, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(n)]
    completions[5] = completions[5][:1]
    return Rollout(prompts, completions, [[0.0] * len(c) for c in completions], [False] * n, [""] * n)


def _data(model, rollout: Rollout) -> dict:
    """The packed rollout, its engine logprobs the model's own a little off (the IS weights near 1)."""
    data = pack(rollout, 0, torch.device("cpu"))
    with torch.no_grad():
        lp = completion_logps(model, data["input_ids"], data["attention_mask"], data["prompt_lengths"],
                              data["completion_mask"].shape[1])
    noise = 0.02 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(7))
    data["engine_logp"] = (lp + noise) * data["completion_mask"]
    return data


def _update(model, loss_type: str, budget: int | None, beta: float, num_iterations: int,
            share_prompts: bool | None = None) -> PolicyUpdate:
    args = GRPOConfig(output_dir=None, report_to="none", num_generations=4, per_device_train_batch_size=4,
                      gradient_accumulation_steps=2, steps_per_generation=4, max_prompt_length=8,
                      max_completion_length=12, loss_type=loss_type, beta=beta, num_iterations=num_iterations,
                      temperature=0.9, padding_free=budget is not None, max_tokens_per_micro_batch=budget,
                      share_prompts=share_prompts,
                      gradient_checkpointing=False, optim="sgd")
    ref = copy.deepcopy(model).requires_grad_(False) if beta else None
    opt = RecordingSGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    dist = DistributedContext()
    plan = plan_before_loading(model, args, None, {"device": "cpu"}, torch.device("cpu"), False, 1)
    return PolicyUpdate(model, ref, opt, sched, make_strategy(False, dist), dist, args, torch.device("cpu"), False,
                        plan)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta, num_iterations", [(0.0, 1), (0.05, 2)])
@pytest.mark.parametrize("group", [1, 4])
def test_token_budget_micro_batches_change_no_number(loss_type, beta, num_iterations, group):
    """Token-budget micro-batches (padding-free) against fixed padded ones of 4 rows: the same
    per-token logprobs, loss and gradients, step by step, for every loss_type; 2 optimizer steps
    a phase, with a reference model and old logprobs in the second case. With 4 rows to a prompt
    (group 4) each micro-batch packs a prompt once, whole groups binned, some cut."""
    base = make_tiny_model("llama", seed=3).train()
    data = _data(base, _rollout(group=group))
    advantages = torch.randn(16, generator=torch.Generator().manual_seed(2))
    runs = {}
    for budget in (None, 24):
        model = copy.deepcopy(base)
        update = _update(model, loss_type, budget, beta, num_iterations)
        d, _, split = update._micro_batches(data)
        lp = update._no_grad_logps(model, d, [s for step in split.steps for s in step])
        if split.order is not None:  # back to the rollout's row order
            lp = lp[torch.argsort(split.order)]
        # (the token-budget run takes its advantages as the function that scores them, as the
        # trainer gives them: called once the first forward is launched, then reordered)
        given = advantages if budget is None else (lambda: advantages)
        metrics = update.run(data, given, SimpleNamespace(global_step=0), lambda: None)
        runs[budget] = lp, metrics, update.optimizer.grads, split, model
    (lp_f, m_f, g_f, fixed, model_f), (lp_b, m_b, g_b, split, _) = runs[None], runs[24]
    assert [len(s) for s in split.steps] != [len(s) for s in fixed.steps]  # regrouped, not the same split
    assert split.order is not None and not torch.equal(split.order, torch.arange(16))
    torch.testing.assert_close(lp_b, lp_f, rtol=1e-5, atol=1e-5)
    assert m_b["loss"] == pytest.approx(m_f["loss"], abs=1e-5)
    assert m_b["grad_norm"] == pytest.approx(m_f["grad_norm"], rel=1e-5)
    assert len(g_b) == len(g_f) == 2 * num_iterations  # one optimizer step per 8 rows, as before
    for step_b, step_f in zip(g_b, g_f):
        for (n, _), a, b in zip(model_f.named_parameters(), step_b, step_f):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    assert m_f["train/micro_batches"] == 2 and m_b["train/micro_batches"] == len(split.tokens) / 2
    assert m_b["train/tokens"] == m_f["train/tokens"] == data["attention_mask"].sum().item()
    assert m_f["train/computed_tokens"] == m_f["train/tokens"]  # padded rows share nothing
    assert (m_b["train/computed_tokens"] < m_b["train/tokens"]) == (group > 1)
    assert 0.5 < m_b["train/micro_batch_fill"] <= 1 and "train/micro_batch_fill" not in m_f


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_a_token_budget_step_is_the_fixed_padded_step(tmp_path, loss_type):
    """End to end through the trainer: engine rollouts, one SGD step; equal weights after it are
    equal gradients."""
    from tests.rl.test_trainer import make_trainer

    steps = [make_trainer(tmp_path / str(b), max_steps=1, optim="sgd", loss_type=loss_type, padding_free=bool(b),
                          max_tokens_per_micro_batch=b) for b in (None, 48)]
    padded, budget = (t.step() for t in steps)
    assert budget["loss"] == pytest.approx(padded["loss"], abs=1e-5)
    assert padded["train/micro_batches"] == 2 and budget["train/micro_batches"] > 2
    assert budget["train/tokens"] == padded["train/tokens"]
    for (n, a), b in zip(steps[0].model.named_parameters(), steps[1].model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")
