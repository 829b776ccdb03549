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
from tandem.rl.loss import grpo_loss, loss_kwargs_from_config
from tandem.rl.memory_plan import GIB, MemoryPlan
from tandem.rl.memory_setup import plan_with_measured_activations
from tandem.rl.memory_stats import PeakMemory


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
        self.recompute = self.memory_plan.recompute

    def run(self, data: dict, advantages: torch.Tensor, state, on_weights_changed: Callable[[], None],
            peaks: PeakMemory | None = None, outside: int = 0) -> dict:
        """Optimise on one packed rollout (`rollout.pack`): num_iterations passes of
        gradient-accumulated optimizer steps, counted in `state.global_step`; returns the means of
        the metrics over every rank's micro-batches. `peaks` records the train and optimizer-step
        phases (`outside`: the engine's bytes mapped outside torch's allocator meanwhile)."""
        a = self.args
        peaks = peaks or PeakMemory(self.device)
        if self.scorer is not None:
            notify = on_weights_changed

            def on_weights_changed():
                notify()
                self.scorer.mark_stale()
        cuda = self.device.type == "cuda"
        resident = torch.cuda.memory_allocated(self.device) if cuda else 0
        peaks.begin("train", outside)
        N = data["completion_mask"].shape[0]
        mb = a.per_device_train_batch_size
        micro = [slice(s, min(s + mb, N)) for s in range(0, N, mb)]
        needs_old = a.num_iterations > 1 or a.steps_per_generation > a.gradient_accumulation_steps
        old_logp = self.logps(self.model, data, no_grad=True) if needs_old else None
        ref_logp = self.logps(self.ref_model, data, no_grad=True) if self.ref_model is not None else None
        sums: dict[str, float] = {}
        count = 0
        ga = a.gradient_accumulation_steps
        for _ in range(a.num_iterations):
            for g in range(0, len(micro), ga):
                group = micro[g : g + ga]
                # dapo divides by the tokens of the whole step, all ranks'; the other loss types
                # average over all ranks' micro-batches: the gradient all-reduce is then a SUM.
                tokens = self.dist.all_reduce_sum(sum(data["completion_mask"][s].sum() for s in group))
                num_micro = len(group) * self.dist.world_size
                first_bad = None
                for s in group:
                    logp = self.logps(self.model, data, rows=s)
                    loss, m = grpo_loss(
                        logp, None if old_logp is None else old_logp[s], advantages[s],
                        data["completion_mask"][s], engine_logp=data["engine_logp"][s]
                        if a.vllm_importance_sampling_correction else None,
                        ref_logp=None if ref_logp is None else ref_logp[s],
                        num_items_in_batch=tokens, num_micro_batches=num_micro, **self.loss_kwargs,
                    )
                    loss.backward()
                    m["loss"] = loss.detach() * num_micro
                    for k, v in m.items():
                        sums[k] = sums.get(k, 0.0) + float(v)
                    if first_bad is None and not is_finite(m["loss"]):
                        what = "logprobs" if not torch.isfinite(logp.detach()).all() else "loss"
                        first_bad = f"the trainer's {what} of rows {s.start}-{s.stop - 1}"
                    count += 1
                self.strategy.reduce_grads(self.model)
                # The norm is global (after the all-reduce / over every shard); inf max_norm only
                # measures it. A NaN norm must not reach clipping: it would scale every gradient by NaN.
                norm = self.strategy.clip_grad_norm(self.model.parameters(), a.max_grad_norm or math.inf)
                local_bad = torch.tensor(float(first_bad is not None), device=self.device)
                finite = is_finite(norm) and float(self.dist.all_reduce_sum(local_bad)) == 0
                if a.max_grad_norm:
                    sums["grad_norm"] = sums.get("grad_norm", 0.0) + norm * len(group)
                if not finite and first_bad is None:
                    first_bad = first_nonfinite_grad(self.model)
                state.global_step += 1
                if self.guard.allow_step(state.global_step, finite, first_bad, nonfinite_hint(a, self.use_bf16)):
                    peaks.begin("optimizer step", outside)
                    self.optimizer.step()
                    self.scheduler.step()
                    peaks.begin("train", outside)
                    on_weights_changed()
                self.optimizer.zero_grad(set_to_none=True)
        sums = self.dist.sum_dicts({**sums, "_count": float(count)})  # means over every rank's micro-batches
        count = sums.pop("_count")
        metrics = {k: v / max(1, count) for k, v in sums.items()}
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

    def logps(self, model, data: dict, rows: slice = slice(None), no_grad: bool = False) -> torch.Tensor:
        """Per-token logprobs [rows, T] of the packed rollout's completions under `model`, in the
        trainer's precision and under the engine's sampling distribution. With a scorer
        (batch_invariant) the policy's values are the scorer's, exact; the HF forward gives their
        gradient."""
        exact = None
        if self.scorer is not None and model is self.model:
            exact = self.scorer.logps(data["input_ids"][rows], data["attention_mask"][rows],
                                      data["prompt_lengths"][rows], data["completion_mask"].shape[1],
                                      self.args.temperature)
            if no_grad:
                return exact
        # No autocast weight cache: each weight is cast once a forward anyway, and under recompute the
        # cache would hold a bf16 copy of every weight to the forward's end (2 B a parameter).
        autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16, cache_enabled=False)
                    if self.use_bf16 else nullcontext())
        with torch.no_grad() if no_grad else nullcontext(), autocast:
            logp = completion_logps(model, data["input_ids"][rows], data["attention_mask"][rows],
                                    data["prompt_lengths"][rows], data["completion_mask"].shape[1],
                                    self.args.temperature, self.args.per_device_train_batch_size,
                                    head_dtype=torch.bfloat16 if self.use_bf16 else None,
                                    sampling=self.sampling_filter, padding_free=self.args.padding_free)
        return logp if exact is None else logp + (exact - logp).detach()
