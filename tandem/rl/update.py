"""The training phase of a GRPO step: one packed rollout's logprobs, the loss, backward and the
optimizer steps, each guarded against non-finite values (`guard.py`), with recompute chosen by the
memory plan (`memory_plan.py`, made final here with the activations measured on the model). The
trainer (`trainer.py`) generates and scores; this optimises.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext

import torch

from tandem.rl.config import GRPOConfig
from tandem.rl.guard import NonFiniteGuard, first_nonfinite_grad, is_finite, nonfinite_hint
from tandem.rl.logprobs import SamplingFilter, completion_logps
from tandem.rl.loss import grpo_loss, loss_kwargs_from_config, step_row_scales
from tandem.rl.memory_plan import GIB, MemoryPlan
from tandem.rl.memory_setup import plan_with_measured_activations
from tandem.rl.memory_stats import PeakMemory
from tandem.rl.packing import use_varlen_attention
from tandem.rl.micro_batches import MicroBatches, fixed_steps, split_rows


class PolicyUpdate:
    """Built once the model is final (LoRA applied, FSDP shards laid out) and the optimizer and
    schedule exist."""

    def __init__(self, model, ref_model, optimizer, scheduler, strategy, dist, args: GRPOConfig,
                 device: torch.device, use_bf16: bool, memory_plan: MemoryPlan, scorer=None):
        self.model, self.ref_model = model, ref_model
        self.scorer = scorer  # batch_invariant: the policy's logprob values (`scorer.py`)
        self.optimizer, self.scheduler = optimizer, scheduler
        self.strategy, self.dist, self.args = strategy, dist, args
        self.device, self.use_bf16 = device, use_bf16
        self.loss_kwargs = loss_kwargs_from_config(args)
        # With top-k/top-p/min-p the engine reports logprobs of the truncated distribution: the
        # trainer scores under the same one, so the engine/trainer ratio stays at 1.
        filt = SamplingFilter(args.top_k, args.top_p, args.min_p)
        self.sampling_filter = filt if filt.active else None
        self.guard = NonFiniteGuard(args.max_consecutive_nonfinite_steps)
        # recompute or not, chosen once: by the plan, from what a forward pass of this model saves
        self.memory_plan = plan_with_measured_activations(memory_plan, model, use_bf16, strategy.sharded)
        if args.padding_free:  # after the probe, which runs padded rows
            for m in (model, ref_model):
                if m is not None:
                    use_varlen_attention(m)
        self.recompute = self.memory_plan.recompute

    def run(self, data: dict, advantages: torch.Tensor | Callable[[], torch.Tensor], state,
            on_weights_changed: Callable[[], None], peaks: PeakMemory | None = None, outside: int = 0) -> dict:
        """Optimise on one packed rollout (`rollout.pack`): num_iterations passes of
        gradient-accumulated optimizer steps, counted in `state.global_step`; returns the means of
        the metrics over every rank's micro-batches (loss and grad_norm: over optimizer steps).
        `advantages` [N] may come as the function that computes them (the rollout's rewards): it is
        called once the first forward pass is launched, so the device runs that pass while the host
        scores (the first loss is the first thing that needs them). `peaks` records the train and
        optimizer-step phases (`outside`: the engine's bytes mapped outside torch's allocator
        meanwhile)."""
        a = self.args
        peaks = peaks or PeakMemory(self.device)
        cuda = self.device.type == "cuda"
        resident = torch.cuda.memory_allocated(self.device) if cuda else 0
        peaks.begin("train", outside)
        data, scale, split = self._micro_batches(data)
        pending = advantages if callable(advantages) else None
        if pending is None:
            advantages = split.reorder(advantages)
        micro = [s for step in split.steps for s in step]
        budget = a.max_tokens_per_micro_batch
        fill = {s.start: t / budget for s, t in zip(micro, split.tokens)} if budget else {}
        needs_old = a.num_iterations > 1 or a.steps_per_generation > a.gradient_accumulation_steps
        old_logp = self._no_grad_logps(self.model, data, micro) if needs_old else None
        ref_logp = self._no_grad_logps(self.ref_model, data, micro) if self.ref_model is not None else None
        # Summed on the device and read once a step: a read-back per micro-batch would empty the
        # device's queue each time, and the host would then launch the next forward with it idle.
        sums: dict[str, torch.Tensor | float] = {}  # per micro-batch
        counts: dict[str, torch.Tensor | float] = {}  # micro-batches that had a value (NaN: none)
        step_losses = torch.zeros((), device=self.device)  # this rank's micro-batches' shares
        step_norms = 0.0  # summed over steps
        count = num_steps = 0
        for _ in range(a.num_iterations):
            for group in split.steps:
                finite = []  # per micro-batch: (loss, logprobs) finite, on the device
                for s in group:
                    logp = self.logps(self.model, data, rows=s)
                    if pending is not None:
                        advantages, pending = split.reorder(pending()), None
                    loss, m = grpo_loss(
                        logp, None if old_logp is None else old_logp[s], advantages[s],
                        data["completion_mask"][s], engine_logp=data["engine_logp"][s]
                        if a.vllm_importance_sampling_correction else None,
                        ref_logp=None if ref_logp is None else ref_logp[s], row_scale=scale[s], **self.loss_kwargs,
                    )
                    loss.backward()
                    step_losses += loss.detach()  # this micro-batch's share of the step's loss
                    if budget:  # the share of the budget this micro-batch's real tokens take
                        m["train/micro_batch_fill"] = fill[s.start]
                    for k, v in m.items():
                        if torch.is_tensor(v):
                            v = v.detach().float()
                            sums[k] = sums.get(k, 0.0) + torch.where(v.isnan(), 0.0, v)
                            counts[k] = counts.get(k, 0.0) + (~v.isnan()).float()
                        else:
                            sums[k], counts[k] = sums.get(k, 0.0) + float(v), counts.get(k, 0.0) + 1.0
                    finite.append(torch.stack([torch.isfinite(loss.detach()), torch.isfinite(logp.detach()).all()]))
                    count += 1
                first_bad = _first_nonfinite(torch.stack(finite).tolist(), group, split)
                self.strategy.reduce_grads(self.model)
                # The norm is global (after the all-reduce / over every shard); inf max_norm only
                # measures it. A NaN norm must not reach clipping: it would scale every gradient by NaN.
                norm = self.strategy.clip_grad_norm(self.model.parameters(), a.max_grad_norm or math.inf)
                local_bad = torch.tensor(float(first_bad is not None), device=self.device)
                finite = is_finite(norm) and float(self.dist.all_reduce_sum(local_bad)) == 0
                step_norms += norm
                num_steps += 1
                if not finite and first_bad is None:
                    first_bad = first_nonfinite_grad(self.model)
                state.global_step += 1
                if self.guard.allow_step(state.global_step, finite, first_bad, nonfinite_hint(a, self.use_bf16)):
                    peaks.begin("optimizer step", outside)
                    self.optimizer.step()
                    self.scheduler.step()
                    peaks.begin("train", outside)
                    on_weights_changed()
                    if self.scorer is not None:
                        self.scorer.mark_stale()
                self.optimizer.zero_grad(set_to_none=True)
        if pending is not None:  # (no micro-batch ran: the rewards are still scored)
            pending()
        host = _to_host({**sums, **{f"_n/{k}": v for k, v in counts.items()}})
        totals = self.dist.sum_dicts({**host, "_count": float(count), "_loss": float(step_losses),
                                      "_tokens": float(sum(split.tokens)),
                                      "_real": float((data["seq_lens_cpu"] if "seq_lens_cpu" in data
                                                      else data["attention_mask"]).sum())})
        count, loss_sum, tokens = totals.pop("_count"), totals.pop("_loss"), totals.pop("_tokens")
        real = totals.pop("_real")
        # means over every rank's micro-batches that had a value (NaN where none had)
        metrics = {k: totals[k] / totals[f"_n/{k}"] if totals[f"_n/{k}"] else math.nan for k in sums}
        metrics["loss"] = loss_sum / max(1, num_steps)  # every rank's shares: the steps' losses
        if a.max_grad_norm:
            metrics["grad_norm"] = step_norms / max(1, num_steps)  # global already
        metrics["train/micro_batches"] = len(micro) / len(split.steps)  # per optimizer step, each rank
        metrics["train/tokens"] = real  # real prompt + completion tokens of the rows, every rank's
        metrics["train/computed_tokens"] = tokens  # what the forward passes ran: shared prompts once
        metrics["train/nonfinite_steps"] = self.guard.total
        peaks.end()
        metrics["memory/recompute"] = float(self.recompute)
        metrics["memory/optim_offload"] = float(self.memory_plan.offload)
        # the plan's steady-state totals, beside the measured peaks (`memory/<phase>_peak_gib`)
        for phase, total in zip(("generate", "train", "optimizer_step"), self.memory_plan.totals()):
            metrics[f"memory/plan_{phase}_gib"] = total / GIB
        if cuda:
            metrics["memory/train_resident_gib"] = resident / GIB
        self.guard.warn_if_dropped_wholesale(state.global_step, metrics, a.vllm_importance_sampling_mode)
        return metrics

    def _micro_batches(self, data: dict) -> tuple[dict, torch.Tensor, MicroBatches]:
        """Each optimizer step's micro-batches (`micro_batches.py`), the rows reordered so each is a
        contiguous slice (`MicroBatches.reorder` does the same to per-row values), and each row's
        weight in its step's loss. The weights come from the fixed micro-batches (TRL's), so a
        token-budget split changes no number."""
        a = self.args
        mask = data["completion_mask"]
        fixed = fixed_steps(mask.shape[0], a.per_device_train_batch_size, a.gradient_accumulation_steps)
        scale = torch.cat([self._row_scales(mask, step) for step in fixed])  # [N]
        split = split_rows(data["attention_mask"], a.per_device_train_batch_size, a.gradient_accumulation_steps,
                           a.max_tokens_per_micro_batch, self.dist.all_reduce_max, self._prompt_groups(data))
        if split.order is not None:
            host = split.order.cpu()
            data = {k: v[host if v.device.type == "cpu" else split.order] for k, v in data.items()}
        return data, split.reorder(scale), split

    def _prompt_groups(self, data: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rows' (prompt lengths, prompt group ids) on the host when micro-batches pack each
        prompt once (`GRPOConfig.share_prompts`); None when they do not."""
        if not self.args.shares_prompts or "prompt_groups_cpu" not in data:
            return None
        return data["prompt_lengths_cpu"], data["prompt_groups_cpu"]

    def _row_scales(self, mask: torch.Tensor, step: list[slice]) -> torch.Tensor:
        """One optimizer step's normalisation, per row (`loss.step_row_scales`). dapo divides by
        the tokens of the whole step, all ranks'; the other loss types average over all ranks'
        micro-batches: the gradient all-reduce is then a SUM."""
        tokens = self.dist.all_reduce_sum(sum(mask[s].sum() for s in step))
        return step_row_scales(mask, self.args.loss_type, step, self.args.max_completion_length,
                               tokens, len(step) * self.dist.world_size)

    def _no_grad_logps(self, model, data: dict, micro: list[slice]) -> torch.Tensor:
        """Logprobs [N, T] of every row without a graph, one micro-batch at a time."""
        return torch.cat([self.logps(model, data, rows=s, no_grad=True) for s in micro])

    def logps(self, model, data: dict, rows: slice = slice(None), no_grad: bool = False) -> torch.Tensor:
        """Per-token logprobs [rows, T] of the packed rollout's completions under `model`, in the
        trainer's precision and under the engine's sampling distribution. Under a token budget
        `rows` is one micro-batch and runs as one forward pass. With a scorer (batch_invariant) the
        policy's values are the scorer's, exact; the HF forward gives their gradient."""
        a = self.args
        exact = None
        if self.scorer is not None and model is self.model:
            exact = self.scorer.logps(data["input_ids"][rows], data["attention_mask"][rows],
                                      data["prompt_lengths"][rows], data["completion_mask"].shape[1], a.temperature)
            if no_grad:
                return exact
        # No autocast weight cache: each weight is cast once a forward anyway, and under recompute the
        # cache would hold a bf16 copy of every weight to the forward's end (2 B a parameter).
        autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16, cache_enabled=False)
                    if self.use_bf16 else nullcontext())
        micro_batch_size = None if a.max_tokens_per_micro_batch else a.per_device_train_batch_size
        groups = self._prompt_groups(data)
        groups = None if groups is None else groups[1][rows]
        with torch.no_grad() if no_grad else nullcontext(), autocast:
            logp = completion_logps(model, data["input_ids"][rows], data["attention_mask"][rows],
                                    data["prompt_lengths"][rows], data["completion_mask"].shape[1],
                                    a.temperature, micro_batch_size,
                                    head_dtype=torch.bfloat16 if self.use_bf16 else None,
                                    sampling=self.sampling_filter, padding_free=a.padding_free,
                                    lengths_cpu=_lengths_cpu(data, rows), prompt_groups=groups)
        return logp if exact is None else logp + (exact - logp).detach()


def _lengths_cpu(data: dict, rows: slice) -> tuple[torch.Tensor, torch.Tensor] | None:
    if "seq_lens_cpu" not in data:
        return None
    return data["prompt_lengths_cpu"][rows], data["seq_lens_cpu"][rows]


def _first_nonfinite(finite: list[list[bool]], group: list[slice], split: MicroBatches) -> str | None:
    """Which of a step's micro-batches first had a non-finite loss, and whether its logprobs were."""
    for (loss_ok, logp_ok), s in zip(finite, group):
        if not loss_ok:
            return f"the trainer's {'loss' if logp_ok else 'logprobs'} of {split.describe(s)}"
    return None


def _to_host(sums: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """The device-side sums as floats, in one read-back."""
    on_device = [k for k, v in sums.items() if torch.is_tensor(v)]
    values = torch.stack([sums[k] for k in on_device]).tolist() if on_device else []
    return {**sums, **dict(zip(on_device, values))}
