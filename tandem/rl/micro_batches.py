"""Which rows of a training phase go into which micro-batch (`GRPOConfig.max_tokens_per_micro_batch`).

An optimizer step takes per_device_train_batch_size x gradient_accumulation_steps rows, as in TRL.
Without a token budget its micro-batches are per_device_train_batch_size rows each, in order. With
one (verl's use_dynamic_bsz + ppo_max_token_len_per_gpu) the step's rows are grouped so that each
micro-batch holds at most the budget's real tokens (prompt + completion, no padding), about equally
full: longest row first into the least-filled of k = ceil(tokens / budget) micro-batches, k raised
while one overflows. The rows are then reordered so each micro-batch is a contiguous slice.

With shared prompts (`GRPOConfig.share_prompts`) the units binned are a prompt's rows together,
each costing its prompt once.

The loss is normalised over the whole step (`loss.step_row_scales`, over the fixed micro-batches),
so the grouping changes neither the loss nor the gradients. A row longer than the budget is an
error, as in verl: the budget bounds a micro-batch's memory, and a micro-batch above it would
break that bound in the middle of a run.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.rl.packing import rows_by_prompt


@dataclass
class MicroBatches:
    """One training phase's split: for each optimizer step, its micro-batches as contiguous slices
    of the phase's rows once reordered by `order` (None: kept in order)."""

    order: torch.Tensor | None  # [N] the original row at each position
    steps: list[list[slice]]
    tokens: list[int]  # real tokens of each micro-batch, in order

    def reorder(self, values: torch.Tensor) -> torch.Tensor:
        """Per-row values [N] in the micro-batches' row order."""
        return values if self.order is None else values[self.order]

    def describe(self, s: slice) -> str:
        """The original rows a micro-batch holds, for messages."""
        if self.order is None:
            return f"rows {s.start}-{s.stop - 1}"
        return "rows " + ", ".join(map(str, sorted(self.order[s].tolist())))


def describe(args) -> str:
    """One line for the run's start: how a training phase's rows become micro-batches."""
    size = (f"of at most {args.max_tokens_per_micro_batch:,} tokens" if args.max_tokens_per_micro_batch
            else f"of {args.per_device_train_batch_size} rows")
    if not args.padding_free:
        return (f"micro-batches: padded rows, {size} (padding_free=True packs them: no FLOP on padding, "
                "and each prompt once with its completions)")
    shared = ("each prompt packed once with its completions" if args.shares_prompts
              else "each row with its own prompt (share_prompts=False)")
    return f"micro-batches: padding-free, {size}, {shared}"


def fixed_steps(num_rows: int, rows_per_micro_batch: int, micro_batches_per_step: int) -> list[list[slice]]:
    """TRL's split: micro-batches of rows_per_micro_batch rows, gradient_accumulation_steps of them
    to an optimizer step."""
    micro = [slice(s, min(s + rows_per_micro_batch, num_rows)) for s in range(0, num_rows, rows_per_micro_batch)]
    return [micro[g : g + micro_batches_per_step] for g in range(0, len(micro), micro_batches_per_step)]


def balanced_bins(lengths: list[int], k: int) -> list[list[int]]:
    """Indices of `lengths` in k bins of about equal sums: longest first, each into the bin with the
    least so far (the lowest bin on ties); each bin's indices ascending."""
    heap = [(0, b) for b in range(k)]
    bins: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (load + lengths[i], b))
    return [sorted(b) for b in bins if b]


def token_budget_bins(lengths: list[int], budget: int, agree: Callable[[int], int] = lambda v: v,
                      groups: PromptGroups | None = None) -> list[list[int]]:
    """`lengths` (one optimizer step's rows) in as few balanced bins of at most `budget` tokens as
    the greedy finds. `agree` is the max over data-parallel ranks: every rank runs the same number
    of micro-batches (FSDP gathers per forward pass), and all raise together on a row too long.
    `groups`: what is binned is each prompt's rows together (`PromptGroups`; None: each row)."""
    longest = agree(max(lengths))
    if longest > budget:
        raise ValueError(
            f"a sequence of {longest} tokens (prompt + completion) is longer than "
            f"max_tokens_per_micro_batch ({budget}); raise it, or set max_prompt_length so that "
            "max_prompt_length + max_completion_length fits"
        )
    groups = PromptGroups.of_rows(lengths) if groups is None else groups
    units = groups.units(budget)
    k = math.ceil(sum(map(groups.cost, units)) / budget)
    while True:
        k = agree(k)
        units = groups.cut(units, k)  # k micro-batches need k units; every rank runs k (FSDP)
        bins = [sorted(i for u in b for i in units[u]) for b in balanced_bins(list(map(groups.cost, units)), k)]
        if not agree(int(any(groups.cost(b) > budget for b in bins))):
            return bins
        k += 1


class PromptGroups:
    """One step's rows by prompt, when a micro-batch packs each prompt once: a set of rows costs
    each prompt once and each completion (`cost`), and the budget bins a prompt's rows together
    (`units`), cut where they are over it or where there are fewer units than micro-batches."""

    def __init__(self, lengths: list[int], prompt_lens: list[int], ids: list[int]):
        self.lengths, self.prompt_lens, self.ids = lengths, prompt_lens, ids

    @classmethod
    def of_rows(cls, lengths: list[int]) -> PromptGroups:
        """Rows that share nothing: each its own unit, costing its own tokens."""
        return cls(lengths, [0] * len(lengths), list(range(len(lengths))))

    def take(self, rows) -> PromptGroups:
        """These rows alone, numbered from 0."""
        return PromptGroups(*([v[i] for i in rows] for v in (self.lengths, self.prompt_lens, self.ids)))

    def cost(self, rows) -> int:
        prompts = {self.ids[i]: self.prompt_lens[i] for i in rows}
        return sum(prompts.values()) + sum(self.lengths[i] - self.prompt_lens[i] for i in rows)

    def units(self, budget: int) -> list[list[int]]:
        """Each prompt's rows in order, cut before a row that would take them over `budget` (a row
        over it alone stays whole: token_budget_bins has refused it)."""
        units = []
        for rows in rows_by_prompt(self.ids):
            unit: list[int] = []
            for i in rows:
                if unit and self.cost(unit + [i]) > budget:
                    units.append(unit)
                    unit = []
                unit.append(i)
            units.append(unit)
        return units

    @staticmethod
    def cut(units: list[list[int]], k: int) -> list[list[int]]:
        """At least k units where the rows allow: the unit of most rows halved until there are."""
        units = list(units)
        while len(units) < k and max(map(len, units)) > 1:
            big = max(range(len(units)), key=lambda u: len(units[u]))
            rows = units.pop(big)
            units[big:big] = [rows[: len(rows) // 2], rows[len(rows) // 2 :]]
        return units


def split_rows(attention_mask: torch.Tensor, rows_per_micro_batch: int, micro_batches_per_step: int,
               budget: int | None = None, agree: Callable[[int], int] = lambda v: v,
               prompts: tuple[torch.Tensor, torch.Tensor] | None = None) -> MicroBatches:
    """The phase's micro-batches: fixed (`budget` None), or by token budget within each step.
    `prompts`: the rows' (prompt lengths, prompt group ids) on the host when a micro-batch packs
    each prompt once (`GRPOConfig.share_prompts`): a micro-batch's tokens then count a group's
    prompt once, and a budget bins a prompt's rows together (`PromptGroups`)."""
    lengths = attention_mask.sum(-1).tolist()  # real tokens of each row
    rows_of = (PromptGroups.of_rows(lengths) if prompts is None
               else PromptGroups(lengths, prompts[0].tolist(), prompts[1].tolist()))
    steps = fixed_steps(len(lengths), rows_per_micro_batch, micro_batches_per_step)
    if budget is None:
        return MicroBatches(None, steps, [rows_of.cost(range(s.start, s.stop)) for step in steps for s in step])
    order: list[int] = []
    split, tokens = [], []
    for step in steps:
        rows = range(step[0].start, step[-1].stop)
        local = rows_of.take(rows)
        micro = []
        for b in token_budget_bins(local.lengths, budget, agree, local):
            micro.append(slice(len(order), len(order) + len(b)))
            order += [rows[i] for i in b]
            tokens.append(rows_of.cost([rows[i] for i in b]))
        split.append(micro)
    return MicroBatches(torch.tensor(order, device=attention_mask.device), split, tokens)
