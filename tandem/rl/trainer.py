"""GRPOTrainer: the colocated loop of docs/architecture.md on one device.

wake -> weights from the trainer -> G completions per prompt (with logprobs) -> sleep -> rewards ->
group-relative advantages -> loss (clip, IS correction, optional KL) -> optimizer step.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path

import torch

from tandem.engine.gc_pause import frozen_heap
from tandem.rl import checkpoint as ckpt
from tandem.rl.config import GRPOConfig
from tandem.rl.data import RepeatSampler, build_prompt_batch, load_prompt_dataset
from tandem.rl.distributed import DistributedContext, gather_rewards
from tandem.rl.generation import ColocatedGenerator, ServerGenerator
from tandem.rl.guard import NonFiniteGuard, first_nonfinite_grad, is_finite
from tandem.rl.logging import MetricsLogger
from tandem.rl.logprobs import SamplingFilter, completion_logps
from tandem.rl.loss import (
    group_advantages,
    grpo_loss,
    loss_kwargs_from_config,
    reward_metrics,
)
from tandem.rl.rewards import RewardComputer, wrap_completions
from tandem.rl.rollout import Rollout, pack
from tandem.sampling_params import SamplingParams

PHASES = ("weight_sync", "generate", "reward", "train")  # one step, in order


class GRPOTrainer:
    """TRL's GRPOTrainer interface, with tandem's engine in the same process and on the same GPU."""

    def __init__(
        self,
        model,
        reward_funcs: Callable | Sequence[Callable],
        args: GRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        engine_kwargs: dict | None = None,
    ):
        self.args = args = args or GRPOConfig()
        if train_dataset is None:
            raise ValueError("train_dataset is required (tandem.rl.data.arithmetic_dataset gives a built-in one)")
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model, self.tokenizer = self._load_model(model, processing_class)
        # Data parallel under torchrun: each rank trains a replica on its slice of every batch.
        self.dist = DistributedContext.from_environment()
        self.dist.broadcast_params(self.model)
        self.train_dataset = load_prompt_dataset(train_dataset)
        self.eval_dataset = load_prompt_dataset(eval_dataset) if eval_dataset is not None else None
        self.rewards = RewardComputer(reward_funcs, args.reward_weights)
        self.use_bf16 = args.bf16 if args.bf16 is not None else (
            self.device.type == "cuda" and torch.cuda.is_bf16_supported())
        self._check_lengths()
        self.ref_model = None
        if args.beta != 0.0:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        if args.gradient_checkpointing and self.device.type == "cuda":
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.model.config.use_cache = False
        self.llm = None
        if args.vllm_mode == "colocate":  # built from the full model, before any sharding
            self.llm = self._build_engine(engine_kwargs or {})
        engine_weights = None  # None: the engine reads the (unsharded) model itself
        if args.fsdp:
            from tandem.rl import fsdp  # torch.distributed.fsdp: a second's import, only when used

            for m in (self.model, self.ref_model):
                if m is not None:
                    fsdp.apply_fsdp(m, self.device, self.use_bf16)
            self.reduce_grads, self.clip_grad_norm = (lambda model: None), fsdp.clip_grad_norm_
            engine_weights = functools.partial(fsdp.full_weights, self.model)  # one unit at a time
        else:
            self.reduce_grads = self.dist.all_reduce_grads
            self.clip_grad_norm = lambda params, max_norm: float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_epsilon, weight_decay=args.weight_decay,
        )
        self.sampler = RepeatSampler(len(self.train_dataset),
                                     batch_size=args.prompts_per_generation * self.dist.world_size,
                                     shuffle=args.shuffle_dataset, seed=args.seed)
        self.max_steps = self._total_steps()
        from transformers import get_scheduler

        self.scheduler = get_scheduler(
            args.lr_scheduler_type, self.optimizer,
            num_warmup_steps=math.ceil(args.warmup_ratio * self.max_steps), num_training_steps=self.max_steps,
        )
        if args.vllm_mode == "server":
            from tandem.rl.server_client import ServerClient

            client = ServerClient(args.vllm_server_base_url, args.vllm_server_api_key)
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            self.generator = ServerGenerator(client, self.model, backend, torch.bfloat16 if self.use_bf16 else None)
        else:
            sleep_level = args.engine_sleep_level if args.vllm_enable_sleep_mode else None
            self.generator = ColocatedGenerator(self.llm, self.model, sleep_level, engine_weights)
        self.sampling_params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
            repetition_penalty=args.repetition_penalty, max_tokens=args.max_completion_length,
        )
        self.loss_kwargs = loss_kwargs_from_config(args)
        # With top-k/top-p/min-p the engine reports logprobs of the truncated distribution: the
        # trainer scores under the same one, so the engine/trainer ratio stays at 1.
        filt = SamplingFilter(args.top_k, args.top_p, args.min_p)
        self.sampling_filter = filt if filt.active else None
        self.guard = NonFiniteGuard(args.max_consecutive_nonfinite_steps)
        self._warned_dropped = False
        self.global_step = 0
        self.logger: MetricsLogger | None = None

    # -- setup ---------------------------------------------------------------------------------------
    def _load_model(self, model, processing_class):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if isinstance(model, str):
            path = model
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        else:
            path = getattr(model.config, "_name_or_path", None)
        model = model.to(self.device).float().train()  # fp32 master weights; bf16 by autocast
        tok = processing_class
        if tok is None:
            if not path:
                raise ValueError("processing_class (the tokenizer) is required for an in-memory model")
            tok = AutoTokenizer.from_pretrained(path)
        return model, tok

    def _check_lengths(self) -> None:
        a = self.args
        context = getattr(self.model.config, "max_position_embeddings", None)
        need = (a.max_prompt_length or 0) + a.max_completion_length
        if context is not None and need > context:
            raise ValueError(
                f"max_prompt_length + max_completion_length = {need} exceeds the model's context "
                f"({context} tokens); lower one of them"
            )
        if "prompt" not in self.train_dataset.column_names:
            raise ValueError(f"train_dataset needs a 'prompt' column; it has {self.train_dataset.column_names}")

    def _total_steps(self) -> int:
        a = self.args
        per_generation = a.num_iterations * a.steps_per_generation // a.gradient_accumulation_steps
        if a.max_steps > 0:
            return a.max_steps
        return max(1, int(a.num_train_epochs * self.sampler.batches_per_epoch * per_generation))

    def _build_engine(self, engine_kwargs: dict):
        from tandem import LLM

        a = self.args
        kwargs = {
            "tokenizer": self.tokenizer, "dtype": "bfloat16" if self.use_bf16 else "float32",
            "max_model_len": a.vllm_max_model_length or (a.max_prompt_length or 512) + a.max_completion_length,
            "gpu_memory_utilization": a.vllm_gpu_memory_utilization, "enable_sleep_mode": a.vllm_enable_sleep_mode,
            "seed": a.seed, "logprobs_mode": "processed_logprobs", "max_num_seqs": max(8, a.generation_batch_size),
        }
        kwargs.update(engine_kwargs)
        llm = LLM(self.model, **kwargs)
        if a.vllm_enable_sleep_mode:
            llm.sleep(a.engine_sleep_level)
        return llm

    # -- the loop ------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None) -> dict:
        a = self.args
        resume_step = self._resume(resume_from_checkpoint)
        self.logger = MetricsLogger(a.output_dir, a.report_to, resume_step=resume_step) if self.dist.is_main else None
        last = {}
        try:
            with frozen_heap():  # model, optimizer, engine, data: no full GC pass walks them
                while self.global_step < self.max_steps:
                    last = self.step()
                    if a.save_steps and self.global_step % a.save_steps == 0:
                        self.save_checkpoint()
        finally:
            if self.logger is not None:
                self.logger.close()
        return last

    def step(self) -> dict:
        """One generation round and the optimizer steps it feeds; returns the logged metrics."""
        a = self.args
        marks = [time.perf_counter()]  # phase boundaries: weight sync | generate | reward | train
        self.generator.sync()
        marks.append(time.perf_counter())
        indices = self.dist.shard(self.sampler.next_batch())  # this rank's prompts of the global batch
        batch = build_prompt_batch(self.train_dataset, indices, self.tokenizer,
                                   a.max_prompt_length, a.chat_template_kwargs)
        seed = (a.seed * 1_000_003 + self.global_step * 65_537) % (1 << 31)
        offset = self.dist.shard_offset(len(indices))
        rollout = self.generator.rollout(batch, a.num_generations, self.sampling_params, seed, offset)
        marks.append(time.perf_counter())
        prompts = batch.repeated_prompts(a.num_generations)
        local = self.rewards(prompts, wrap_completions(prompts, rollout.texts), rollout.completion_ids,
                             **batch.reward_columns(a.num_generations))
        result = gather_rewards(self.dist, local)  # the global batch's ("batch" scaling needs all)
        rows = slice(offset * a.num_generations, (offset + len(indices)) * a.num_generations)
        advantages = group_advantages(result.rewards, a.num_generations, a.scale_rewards)[rows]
        marks.append(time.perf_counter())
        train_metrics = self._train_on(rollout, advantages.to(self.device))
        marks.append(time.perf_counter())
        # phase -> (perf_counter start, end), for GPU monitors; the logged times are their lengths
        spans = self.last_phase_spans = dict(zip(PHASES, zip(marks, marks[1:])))
        times = {f"time/{k}": end - start for k, (start, end) in spans.items()}
        metrics = {**reward_metrics(result.rewards, a.num_generations), **result.metrics(), **train_metrics,
                   **self._rollout_metrics(rollout), **times, "learning_rate": self.scheduler.get_last_lr()[0],
                   "engine/weights_version": self.generator.weights_version}
        metrics["time/step"] = sum(v for k, v in times.items())
        if self.logger is not None and self.global_step % max(1, a.logging_steps) == 0:
            self.logger.log(self.global_step, metrics)
            if a.log_completions:
                self.logger.log_completions(self.global_step, [self.tokenizer.decode(p) for p in rollout.prompt_ids],
                                            rollout.texts, local.rewards.tolist(), advantages.tolist(),
                                            a.num_completions_to_print)
        return metrics

    def _train_on(self, rollout: Rollout, advantages: torch.Tensor) -> dict:
        a = self.args
        data = pack(rollout, self.tokenizer.pad_token_id or 0, self.device, a.mask_truncated_completions)
        N = data["completion_mask"].shape[0]
        mb = a.per_device_train_batch_size
        micro = [slice(s, min(s + mb, N)) for s in range(0, N, mb)]
        needs_old = a.num_iterations > 1 or a.steps_per_generation > a.gradient_accumulation_steps
        old_logp = self._logps(self.model, data, no_grad=True) if needs_old else None
        ref_logp = self._logps(self.ref_model, data, no_grad=True) if self.ref_model is not None else None
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
                    logp = self._logps(self.model, data, rows=s)
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
                self.reduce_grads(self.model)  # FSDP has reduce-scattered them during backward
                # The norm is global (after the all-reduce / over every shard); inf max_norm only
                # measures it. A NaN norm must not reach clipping: it would scale every gradient by NaN.
                norm = self.clip_grad_norm(self.model.parameters(), a.max_grad_norm or math.inf)
                local_bad = torch.tensor(float(first_bad is not None), device=self.device)
                finite = is_finite(norm) and float(self.dist.all_reduce_sum(local_bad)) == 0
                if a.max_grad_norm:
                    sums["grad_norm"] = sums.get("grad_norm", 0.0) + norm * len(group)
                if not finite and first_bad is None:
                    first_bad = first_nonfinite_grad(self.model)
                self.global_step += 1
                if self.guard.allow_step(self.global_step, finite, first_bad, self._nonfinite_hint()):
                    self.optimizer.step()
                    self.scheduler.step()
                    self.generator.mark_stale()
                self.optimizer.zero_grad(set_to_none=True)
        sums = self.dist.sum_dicts({**sums, "_count": float(count)})  # means over every rank's micro-batches
        count = sums.pop("_count")
        metrics = {k: v / max(1, count) for k, v in sums.items()}
        metrics["train/nonfinite_steps"] = self.guard.total
        self._warn_if_dropped_wholesale(metrics)
        return metrics

    def _nonfinite_hint(self) -> str:
        a = self.args
        hint = f"a lower learning_rate (now {a.learning_rate:g})"
        if self.use_bf16:
            hint += ", bf16=False (fp32) to tell a precision problem from an unstable run"
        return hint + ", or check the reward functions for inf/NaN."

    def _warn_if_dropped_wholesale(self, metrics: dict) -> None:
        """The engine/trainer IS correction zeroing most of a rollout means nothing is being learned."""
        frac = metrics.get("sampling/is_dropped_fraction")
        if frac is None or frac < 0.5 or self._warned_dropped:
            return
        self._warned_dropped = True
        warnings.warn(
            f"step {self.global_step}: the importance-sampling correction "
            f"({self.args.vllm_importance_sampling_mode}) masked or weighted below 1e-3 {frac:.0%} "
            f"of this rollout, so it barely contributes to learning; mean |engine - trainer logprob| is "
            f"{metrics.get('sampling/sampling_logp_difference/mean', float('nan')):.3f}. The engine "
            "and the trainer disagree on the sampling distribution (check that both see the same "
            "weights, dtype and sampling parameters), or widen vllm_importance_sampling_clip_max.",
            stacklevel=2,
        )

    def _logps(self, model, data: dict, rows: slice = slice(None), no_grad: bool = False) -> torch.Tensor:
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16) if self.use_bf16 else nullcontext()
        with torch.no_grad() if no_grad else nullcontext(), autocast:
            return completion_logps(model, data["input_ids"][rows], data["attention_mask"][rows],
                                    data["prompt_lengths"][rows], data["completion_mask"].shape[1],
                                    self.args.temperature, self.args.per_device_train_batch_size,
                                    head_dtype=torch.bfloat16 if self.use_bf16 else None,
                                    sampling=self.sampling_filter)

    def _rollout_metrics(self, r: Rollout) -> dict:
        lens = self.dist.all_gather(torch.tensor([len(c) for c in r.completion_ids], dtype=torch.float32))
        truncated = self.dist.all_gather(torch.tensor(r.truncated, dtype=torch.float32))
        return {
            "completions/mean_length": lens.mean().item(), "completions/min_length": lens.min().item(),
            "completions/max_length": lens.max().item(),
            "completions/clipped_ratio": truncated.sum().item() / max(1, len(truncated)),
            "completions/num_tokens": lens.sum().item(),
        }

    @torch.no_grad()
    def evaluate(self, dataset=None, num_samples: int | None = None) -> dict:
        """Greedy completions for held-out prompts, scored by the reward functions."""
        a = self.args
        dataset = load_prompt_dataset(dataset) if dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs a dataset (or eval_dataset given to the trainer)")
        n = min(len(dataset), num_samples or len(dataset))
        batch = build_prompt_batch(dataset, list(range(n)), self.tokenizer, a.max_prompt_length, a.chat_template_kwargs)
        self.generator.sync()
        texts, token_ids = self.generator.greedy(batch.prompt_ids, a.max_completion_length)
        result = self.rewards(batch.prompts, wrap_completions(batch.prompts, texts), token_ids,
                              **batch.reward_columns(1))
        return {f"eval/{k.removeprefix('rewards/')}": v for k, v in result.metrics().items()} | {
            "eval/reward": torch.nanmean(result.rewards).item(), "eval/num_samples": n}

    # -- checkpoints ---------------------------------------------------------------------------------
    def save_checkpoint(self):
        """Rank 0 writes (replicas are identical; FSDP shards are gathered to it first); all ranks
        return its path once it is complete."""
        state = {"sampler": self.sampler.state_dict(), "config": self.args.to_dict(),
                 "weights_version": self.generator.weights_version, "world_size": self.dist.world_size}
        path = Path(self.args.output_dir) / f"{ckpt.PREFIX}{self.global_step}"
        model_state = optimizer_state = None
        if self.args.fsdp:
            from tandem.rl import fsdp

            model_state, optimizer_state = fsdp.gather_state_dicts(self.model, self.optimizer)
        if self.dist.is_main:
            path = ckpt.save_checkpoint(self.args.output_dir, self.global_step, self.model, tokenizer=self.tokenizer,
                                        optimizer=self.optimizer, scheduler=self.scheduler, trainer_state=state,
                                        save_total_limit=self.args.save_total_limit,
                                        model_state_dict=model_state, optimizer_state_dict=optimizer_state)
        self.dist.barrier()
        return path

    def _resume(self, resume_from_checkpoint) -> int | None:
        if not resume_from_checkpoint:
            return None
        path = (ckpt.latest_checkpoint(self.args.output_dir) if resume_from_checkpoint is True
                else resume_from_checkpoint)
        if path is None:
            raise ValueError(f"resume_from_checkpoint=True but {self.args.output_dir} has no complete checkpoint")
        written = json.loads((Path(path) / ckpt.TRAINER_STATE).read_text())["config"].get("fsdp", False)
        if written != self.args.fsdp:  # the optimizer state is keyed differently (names vs indices)
            raise ValueError(f"{path} was written with fsdp={written}; resume it with fsdp={written}")
        if self.args.fsdp:
            from tandem.rl import fsdp

            state = ckpt.load_checkpoint(path, scheduler=self.scheduler)
            # Rank 0 reads the full weights and optimizer state; each rank keeps its shards.
            weights = ckpt.read_model_weights(path) if self.dist.is_main else {}
            optim = torch.load(Path(path) / ckpt.OPTIMIZER, map_location="cpu", weights_only=True) if self.dist.is_main else {}
            fsdp.scatter_state_dicts(self.model, self.optimizer, weights, optim)
        else:
            state = ckpt.load_checkpoint(path, self.model, self.optimizer, self.scheduler)
        self.sampler.load_state_dict(state["sampler"])
        self.global_step = int(state["global_step"])
        self.generator.mark_stale()
        return self.global_step
