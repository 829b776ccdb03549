"""Which rows of a training phase go into which micro-batch (`GRPOConfig.max_tokens_per_micro_batch`).

An optimizer step takes per_device_train_batch_size x gradient_accumulation_steps rows, as in TRL.
Without a token budget its micro-batches are per_device_train_batch_size rows each, in order. With
one (verl's use_dynamic_bsz + ppo_max_token_len_per_gpu) the step's rows are grouped so that each
micro-batch holds at most the budget's real tokens (prompt + completion, no padding), about equally
full: longest row first into the least-filled of k = ceil(tokens / budget) micro-batches, k raised
while one overflows. The rows are then reordered so each micro-batch is a contiguous slice.

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


@dataclass
class MicroBatches:
    """One training phase's split: for each optimizer step, its micro-batches as contiguous slices
    of the phase's rows once reordered by `order` (None: kept in order)."""

    order: torch.Tensor | None  # [N] the original row at each position
    steps: list[list[slice]]
    tokens: list[int]  # real tokens of each micro-batch, in order

    def describe(self, s: slice) -> str:
        """The original rows a micro-batch holds, for messages."""
        if self.order is None:
            return f"rows {s.start}-{s.stop - 1}"
        return "rows " + ", ".join(map(str, sorted(self.order[s].tolist())))


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


def token_budget_bins(lengths: list[int], budget: int, agree: Callable[[int], int] = lambda v: v) -> list[list[int]]:
    """`lengths` (one optimizer step's rows) in as few balanced bins of at most `budget` tokens as
    the greedy finds. `agree` is the max over data-parallel ranks: every rank runs the same number
    of micro-batches (FSDP gathers per forward pass), and all raise together on a row too long."""
    longest = agree(max(lengths))
    if longest > budget:
        raise ValueError(
            f"a sequence of {longest} tokens (prompt + completion) is longer than "
            f"max_tokens_per_micro_batch ({budget}); raise it, or set max_prompt_length so that "
            "max_prompt_length + max_completion_length fits"
        )
    k = math.ceil(sum(lengths) / budget)
    while True:
        k = agree(k)
        bins = balanced_bins(lengths, k)
        if not agree(int(any(sum(lengths[i] for i in b) > budget for b in bins))):
            return bins
        k += 1


def split_rows(attention_mask: torch.Tensor, rows_per_micro_batch: int, micro_batches_per_step: int,
               budget: int | None = None, agree: Callable[[int], int] = lambda v: v) -> MicroBatches:
    """The phase's micro-batches: fixed (`budget` None), or by token budget within each step."""
    lengths = attention_mask.sum(-1).tolist()  # real tokens of each row
    steps = fixed_steps(len(lengths), rows_per_micro_batch, micro_batches_per_step)
    if budget is None:
        return MicroBatches(None, steps, [sum(lengths[s]) for step in steps for s in step])
    order: list[int] = []
    split, tokens = [], []
    for step in steps:
        first = step[0].start
        bins = token_budget_bins(lengths[first : step[-1].stop], budget, agree)
        micro = []
        for b in bins:
            micro.append(slice(len(order), len(order) + len(b)))
            order += [first + i for i in b]
            tokens.append(sum(lengths[first + i] for i in b))
        split.append(micro)
    return MicroBatches(torch.tensor(order, device=attention_mask.device), split, tokens)
