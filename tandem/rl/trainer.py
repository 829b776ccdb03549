"""GRPOTrainer: the colocated loop of docs/architecture.md on one device.

wake -> weights from the trainer -> G completions per prompt (with logprobs) -> sleep -> rewards ->
group-relative advantages -> loss (clip, IS correction, optional KL) -> optimizer step.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from tandem.engine.gc_pause import frozen_heap
from tandem.models import hub
from tandem.rl import callbacks as callbacks_mod
from tandem.rl import checkpoint as ckpt
from tandem.rl import fused_layers, grad_accum_linear, lora, memory_setup, micro_batches
from tandem.rl.config import GRPOConfig, resolve_interval
from tandem.rl.data import RepeatSampler, build_prompt_batch, load_prompt_dataset
from tandem.rl.distributed import DistributedContext, gather_rewards
from tandem.rl.generation import ColocatedGenerator, ServerGenerator
from tandem.rl.logging import MetricsLogger
from tandem.rl.loss import (
    group_advantages,
    reward_metrics,
)
from tandem.rl.memory_stats import PeakMemory, engine_outside_bytes
from tandem.rl.optim import build_optimizer, build_scheduler
from tandem.rl.reward_models import prepare_reward_funcs
from tandem.rl.rewards import RewardComputer, wrap_completions
from tandem.rl.rollout import Rollout, pack
from tandem.rl.strategy import make_strategy
from tandem.rl.update import PolicyUpdate
from tandem.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

# one step's phases, in order; the reward phase runs inside the train phase unless a reward model
# scores (`GRPOTrainer._step`)
PHASES = ("weight_sync", "generate", "reward", "train")


class GRPOTrainer:
    """TRL's GRPOTrainer interface, with tandem's engine in the same process and on the same GPU."""

    def __init__(
        self,
        model,
        reward_funcs: Callable | str | Sequence[Callable | str],
        args: GRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        peft_config=None,
        engine_kwargs: dict | None = None,
    ):
        if args is None:  # as TRL: output_dir named after the model
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            args = GRPOConfig(output_dir=f"{str(name).rstrip('/').split('/')[-1] or 'model'}-GRPO")
        self.args = args
        if train_dataset is None:
            raise ValueError("train_dataset is required (tandem.rl.data.arithmetic_dataset gives a built-in one)")
        if peft_config is not None and (args.fsdp or args.vllm_mode != "colocate"):
            raise ValueError("peft_config (LoRA) runs with the colocated engine and fsdp=False; the "
                             "adapter is small, so every rank keeps a replica")
        if args.eval_strategy != "no" and eval_dataset is None:
            raise ValueError(f"eval_strategy={args.eval_strategy!r} needs an eval_dataset (or eval_strategy='no')")
        self.peft = peft_config is not None
        self.device = torch.device("cuda" if torch.cuda.is_available() and not args.use_cpu else "cpu")
        self.state = callbacks_mod.make_state(True, args.per_device_train_batch_size, args.num_train_epochs)
        self.control = callbacks_mod.make_control()
        self.use_bf16 = args.bf16 if args.bf16 is not None else (
            self.device.type == "cuda" and torch.cuda.is_bf16_supported())
        # Fused training kernels or HF's ops, chosen once (a request this device cannot run fails here).
        self.fused_kernels, fused_note = fused_layers.resolve(args.fused_kernels, self.device, args.use_liger_kernel)
        # Data parallel under torchrun: each rank trains a replica on its slice of every batch.
        self.dist = DistributedContext.from_environment()
        engine_kwargs = engine_kwargs or {}
        allocator_note = memory_setup.expandable_segments(self.device)
        if allocator_note and self.dist.is_main:
            print(allocator_note, flush=True)
        # Planned from the config before anything loads: a run that cannot fit is refused here.
        self.memory_plan = memory_setup.plan_before_loading(
            self._model_source(model), args, peft_config, self._engine_settings(engine_kwargs), self.device,
            self.use_bf16, self.dist.world_size if args.fsdp else 1, args.trust_remote_code)
        self.model, self.tokenizer = self._load_model(model, processing_class)
        if args.disable_dropout:
            _disable_dropout(self.model)
        if self.fused_kernels:  # before the reference copy, LoRA and sharding: each keeps the patch
            fused_note = fused_layers.patch_model(self.model)
            linear_note = grad_accum_linear.why_off(self.use_bf16, args.fsdp, args.batch_invariant, self.peft)
            fused_note += "\n" + (linear_note or grad_accum_linear.patch_model(self.model))
        if self.dist.is_main:
            print(fused_note, flush=True)
            print(micro_batches.describe(args), flush=True)
        self.dist.broadcast_params(self.model)
        self.train_dataset = load_prompt_dataset(train_dataset)
        self.eval_dataset = load_prompt_dataset(eval_dataset) if eval_dataset is not None else None
        self.rewards = RewardComputer(
            prepare_reward_funcs(reward_funcs, reward_processing_classes, self.device, args.trust_remote_code),
            args.reward_weights)
        self._check_lengths()
        self.ref_model = None
        if args.beta != 0.0 and peft_config is None:  # with LoRA: the model, adapter disabled
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.llm = None
        if args.vllm_mode == "colocate":  # built from the full model, before any sharding
            self.llm = self._build_engine(engine_kwargs)
        if peft_config is not None:  # after the engine: it took the base weights (B = 0: merged)
            self._apply_peft(peft_config)
        self.strategy = make_strategy(args.fsdp, self.dist)  # replicas or FSDP2 shards, chosen once
        self.strategy.prepare((self.model, self.ref_model), self.device, self.use_bf16)
        engine_weights = self.strategy.engine_weights(self.model)
        if peft_config is not None:
            engine_weights = functools.partial(lora.merged_weights, self.model)
        optimizer, scheduler = optimizers if optimizers is not None else (None, None)
        self.optimizer = optimizer if optimizer is not None else build_optimizer(
            self.model, args, self.device, offload=self.memory_plan.offload)
        self.sampler = RepeatSampler(len(self.train_dataset),
                                     batch_size=args.prompts_per_generation * self.dist.world_size,
                                     shuffle=args.shuffle_dataset,
                                     seed=args.seed if args.data_seed is None else args.data_seed)
        self.max_steps = self._total_steps()
        self.scheduler = scheduler if scheduler is not None else build_scheduler(self.optimizer, args, self.max_steps)
        if args.vllm_mode == "server":
            from tandem.rl.server_client import ServerClient

            client = ServerClient(args.vllm_server_base_url, args.vllm_server_api_key)
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            self.generator = ServerGenerator(client, self.model, backend, torch.bfloat16 if self.use_bf16 else None)
        else:
            sleep_level = self.memory_plan.sleep_level  # the plan's (vllm_enable_sleep_mode)
            check = None if peft_config is None else functools.partial(lora.check_engine_has_adapter, self.model)
            self.generator = ColocatedGenerator(self.llm, self.model, sleep_level, engine_weights, check)
        self.structured_outputs = (None if args.vllm_structured_outputs_regex is None
                                   else StructuredOutputsParams(regex=args.vllm_structured_outputs_regex))
        sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
                    "repetition_penalty": args.repetition_penalty, "max_tokens": args.max_completion_length,
                    "structured_outputs": self.structured_outputs}
        try:  # generation_kwargs: more SamplingParams, as TRL hands them to vLLM
            self.sampling_params = SamplingParams(**{**sampling, **(args.generation_kwargs or {})})
        except TypeError as exc:
            raise ValueError(f"generation_kwargs={args.generation_kwargs!r}: {exc} (they are "
                             "tandem.SamplingParams fields, as vLLM's)") from exc
        scorer = None
        if args.batch_invariant:  # the trainer's logprob values from the engine's kernels (scorer.py)
            from tandem.rl.scorer import BatchInvariantScorer

            policy = self.model
            scorer = BatchInvariantScorer(policy.config, self.llm.llm_engine.max_model_len, self.device,
                                          engine_weights or (lambda: policy.state_dict().items()),
                                          torch.bfloat16 if self.use_bf16 else torch.float32)
        self.update = PolicyUpdate(self.model, self.ref_model, self.optimizer, self.scheduler, self.strategy,
                                   self.dist, args, self.device, self.use_bf16, self.memory_plan, scorer)
        self.memory_plan = self.update.memory_plan  # with the activations measured on the model
        if args.vllm_mode == "colocate":  # measured, the plan may put the engine to sleep after all
            self.generator.sleep_level = self.memory_plan.sleep_level
        if self.dist.is_main:  # on stdout, whatever the logging level: what the run will hold, and why
            print(self.memory_plan.format(f"memory plan ({self._model_name(model)})"), flush=True)
        self.peak_memory = PeakMemory(self.device)
        self.global_step = 0
        self.logger: MetricsLogger | None = None
        self.callback_handler = callbacks_mod.make_callback_handler(
            callbacks, self.model, self.tokenizer, self.optimizer, self.scheduler)
        self.state.is_world_process_zero = self.state.is_local_process_zero = self.dist.is_main
        self._in_train = False  # train() decides when to log (its callbacks' control)
        self._completions_to_log = None

    @property
    def global_step(self) -> int:
        """Optimizer steps taken: the TrainerState's, so callbacks and rewards see the same."""
        return self.state.global_step

    @global_step.setter
    def global_step(self, value: int) -> None:
        self.state.global_step = value

    def add_callback(self, callback) -> None:
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback):
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback) -> None:
        self.callback_handler.remove_callback(callback)

    # -- setup ---------------------------------------------------------------------------------------
    def _model_source(self, model):
        """A model name resolved to its local dir; an in-memory model as it is."""
        if isinstance(model, str) and not os.path.isdir(model) and hub.looks_like_repo_id(model):
            return hub.snapshot_dir(model, (self.args.model_init_kwargs or {}).get("revision"))
        return model

    @staticmethod
    def _model_name(model) -> str:
        name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
        return str(name).rstrip("/").split("/")[-1] or "model"

    def _load_model(self, model, processing_class):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if isinstance(model, str):
            kwargs = dict(self.args.model_init_kwargs or {})
            for key in ("dtype", "torch_dtype"):  # fp32 master weights; bf16 by autocast
                kwargs.pop(key, None)
            kwargs.setdefault("trust_remote_code", self.args.trust_remote_code)
            path = self._model_source(model)
            if path != model:
                kwargs.pop("revision", None)  # the snapshot is that revision
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
        else:
            path = getattr(model.config, "_name_or_path", None)
        model = model.to(self.device).float().train()  # fp32 master weights; bf16 by autocast
        tok = processing_class
        if tok is None:
            if not path:
                raise ValueError("processing_class (the tokenizer) is required for an in-memory model")
            tok = AutoTokenizer.from_pretrained(path)
        return model, tok

    def _apply_peft(self, peft_config) -> None:
        self.model = lora.apply_peft(self.model, peft_config)
        self.dist.broadcast_params(self.model)  # the adapters' random init, alike on every rank
        if self.args.beta != 0.0:
            self.ref_model = lora.AdapterDisabled(self.model)

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

    def _engine_settings(self, engine_kwargs: dict) -> dict:
        """The colocated engine's settings, less its tokenizer and KV-cache size."""
        a = self.args
        return {
            "dtype": "bfloat16" if self.use_bf16 else "float32",
            "max_model_len": a.vllm_max_model_length or (a.max_prompt_length or 512) + a.max_completion_length,
            "enable_sleep_mode": a.vllm_enable_sleep_mode is not False, "seed": a.seed,
            "logprobs_mode": "processed_logprobs", "max_num_seqs": max(8, a.generation_batch_size),
            "batch_invariant": a.batch_invariant,
            **engine_kwargs,
        }

    def _build_engine(self, engine_kwargs: dict):
        from tandem import LLM

        a = self.args
        kv = memory_setup.engine_kv_kwargs(self.memory_plan, a, engine_kwargs)
        llm = LLM(self.model, tokenizer=self.tokenizer, **kv, **self._engine_settings(engine_kwargs))
        if self.memory_plan.sleep_level is not None:
            llm.sleep(self.memory_plan.sleep_level)
        return llm

    # -- the loop ------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None) -> dict:
        """Train to max_steps (or until a callback stops it); log, evaluate and checkpoint as the
        strategies say (transformers' DefaultFlowCallback decides), then save the model into
        output_dir unless save_strategy is "no". Returns the last step's metrics."""
        a, state, handler = self.args, self.state, self.callback_handler
        if not resume_from_checkpoint:  # every rank refuses alike; the main one removes
            ckpt.check_fresh_output_dir(a.output_dir, a.overwrite_output_dir, self.dist.is_main)
            self.dist.barrier()
        resume_step = self._resume(resume_from_checkpoint)
        self.logger = (MetricsLogger(a.output_dir, a.report_to, resume_step=resume_step,
                                     total_steps=self.max_steps) if self.dist.is_main else None)
        state.max_steps, state.num_train_epochs = self.max_steps, a.num_train_epochs
        state.logging_steps = resolve_interval(a.logging_steps, self.max_steps)
        state.eval_steps = resolve_interval(a.eval_steps, self.max_steps)
        state.save_steps = resolve_interval(a.save_steps, self.max_steps)
        self._update_epoch()
        self.control = handler.on_train_begin(a, state, self.control)
        last: dict = {}
        self._in_train = True
        try:
            with frozen_heap():  # model, optimizer, engine, data: no full GC pass walks them
                if a.eval_on_start:
                    self._evaluate_and_log()
                while self.global_step < self.max_steps and not self.control.should_training_stop:
                    first = self.global_step + 1
                    self.control = handler.on_step_begin(a, state, self.control)
                    last = self.step()
                    self._update_epoch()
                    self.control = callbacks_mod.steps_of_round(handler, a, state, self.control, first,
                                                                self.global_step)
                    if self.sampler.position == self.sampler.batches_per_epoch:  # the epoch's last round
                        self.control = handler.on_epoch_end(a, state, self.control)
                    self._log_evaluate_save(last)
        finally:
            self._in_train = False
            if self.logger is not None:
                self.logger.close()
        self.control = handler.on_train_end(a, state, self.control)
        if a.save_strategy != "no":
            self.save_model()
        return last

    def _update_epoch(self) -> None:
        per_epoch = max(1, self.sampler.batches_per_epoch)
        self.state.epoch = self.sampler.epoch + self.sampler.position / per_epoch

    def _log_evaluate_save(self, metrics: dict) -> None:
        """What the round's callbacks asked for, at its last step (HF's _maybe_log_save_evaluate)."""
        c = self.control
        if c.should_log:
            c.should_log = False
            self._log(metrics, self._completions_to_log)
        if c.should_evaluate:
            c.should_evaluate = False
            if self.eval_dataset is not None:
                self._evaluate_and_log()
        if c.should_save:
            c.should_save = False
            self.save_checkpoint()
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    def _log(self, metrics: dict, completions=None) -> None:
        if self.logger is not None:
            self.logger.log(self.global_step, metrics)
            if completions is not None:
                self.logger.log_completions(self.global_step, *completions)
        logs = callbacks_mod.log_record(self.state, metrics)
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs=logs)

    def _evaluate_and_log(self) -> dict:
        metrics = self.evaluate()
        self._log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics=metrics)
        return metrics

    def step(self) -> dict:
        """One generation round and the optimizer steps it feeds; returns the logged metrics. No
        full GC pass walks the heap that exists when it starts (`frozen_heap`: train() holds the
        freeze for the whole run; a loop of bare step() calls gets it a step at a time)."""
        with frozen_heap():
            return self._step()

    def _step(self) -> dict:
        a = self.args
        marks = [time.perf_counter()]  # phase boundaries: weight sync | generate | reward | train
        self.generator.sync()
        # after the wake: it empties the cache the train phase reserved, which must not count here
        self.peak_memory.begin("generate", engine_outside_bytes(self.llm, awake=True))
        marks.append(time.perf_counter())
        indices = self.dist.shard(self.sampler.next_batch())  # this rank's prompts of the global batch
        batch = build_prompt_batch(self.train_dataset, indices, self.tokenizer,
                                   a.max_prompt_length, a.chat_template_kwargs)
        seed = (a.seed * 1_000_003 + self.global_step * 65_537) % (1 << 31)
        offset = self.dist.shard_offset(len(indices))
        rollout = self.generator.rollout(batch, a.num_generations, self.sampling_params, seed, offset)
        self.peak_memory.end()
        marks.append(time.perf_counter())
        prompts = batch.repeated_prompts(a.num_generations)
        scored = {}

        def score() -> torch.Tensor:
            start = time.perf_counter()
            local = self.rewards(prompts, wrap_completions(prompts, rollout.texts), rollout.completion_ids,
                                 trainer_state=self.state, **batch.reward_columns(a.num_generations))
            result = gather_rewards(self.dist, local)  # the global batch's ("batch" scaling needs all)
            rows = slice(offset * a.num_generations, (offset + len(indices)) * a.num_generations)
            advantages = group_advantages(result.rewards, a.num_generations, a.scale_rewards)[rows]
            scored.update(local=local, result=result, advantages=advantages, span=(start, time.perf_counter()))
            return advantages.to(self.device)

        # Plain reward functions score on the host while the device runs the first forward pass
        # (`PolicyUpdate.run`); a reward model's forward pass runs first, on its own, as its
        # activations are not in the memory plan of the train phase.
        overlap = not self.rewards.runs_models
        advantages = score if overlap else score()
        data = pack(rollout, self.tokenizer.pad_token_id or 0, self.device, a.mask_truncated_completions)
        train_metrics = self.update.run(data, advantages, self.state, self.generator.mark_stale,
                                        self.peak_memory, engine_outside_bytes(self.llm))
        marks.append(time.perf_counter())
        local, result, advantages = scored["local"], scored["result"], scored["advantages"]
        # phase -> (perf_counter start, end), for GPU monitors; the logged times are their lengths.
        # Overlapped, the reward span lies inside the train span; time/step is the step's wall time.
        spans = dict(zip(PHASES[:2], zip(marks, marks[1:])))
        spans["reward"] = scored["span"]
        spans["train"] = (marks[2] if overlap else scored["span"][1], marks[3])
        self.last_phase_spans = spans
        times = {f"time/{k}": end - start for k, (start, end) in spans.items()}
        metrics = {**reward_metrics(result.rewards, a.num_generations), **result.metrics(), **train_metrics,
                   **self.peak_memory.metrics(),
                   **self._rollout_metrics(rollout), **times, "learning_rate": self.scheduler.get_last_lr()[0],
                   "engine/weights_version": self.generator.weights_version}
        metrics["time/step"] = marks[3] - marks[0]
        self._completions_to_log = None if not a.log_completions else (
            [self.tokenizer.decode(p) for p in rollout.prompt_ids], rollout.texts, local.rewards.tolist(),
            advantages.tolist(), a.num_completions_to_print, local.extra_columns)
        # Inside train() the callbacks' control decides (logging_strategy); a bare step() logs by logging_steps.
        if not self._in_train and self.logger is not None and self.global_step % max(1, int(a.logging_steps)) == 0:
            self._log(metrics, self._completions_to_log)
        return metrics

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
        texts, token_ids = self.generator.greedy(batch.prompt_ids, a.max_completion_length, self.structured_outputs)
        result = self.rewards(batch.prompts, wrap_completions(batch.prompts, texts), token_ids,
                              trainer_state=self.state, **batch.reward_columns(1))
        return {f"eval/{k.removeprefix('rewards/')}": v for k, v in result.metrics().items()} | {
            "eval/reward": torch.nanmean(result.rewards).item(), "eval/num_samples": n}

    # -- checkpoints ---------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None) -> str:
        """The trained model (with LoRA: the adapter, as peft saves it) and the tokenizer, in HF
        format, into output_dir (default args.output_dir), as transformers' Trainer.save_model."""
        out = Path(output_dir or self.args.output_dir)
        model_state, _ = self.strategy.full_state_dicts(self.model, self.optimizer)
        if self.dist.is_main:
            out.mkdir(parents=True, exist_ok=True)
            self.model.save_pretrained(out, state_dict=model_state)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(out)
            (out / "training_args.json").write_text(json.dumps(self.args.to_dict(), indent=2, default=str))
        self.dist.barrier()
        return str(out)

    def save_checkpoint(self):
        """Rank 0 writes (replicas are identical; FSDP shards are gathered to it first); all ranks
        return its path once it is complete."""
        state = {"sampler": self.sampler.state_dict(), "config": self.args.to_dict(),
                 "log_history": self.state.log_history,
                 "weights_version": self.generator.weights_version, "world_size": self.dist.world_size}
        path = Path(self.args.output_dir) / f"{ckpt.PREFIX}{self.global_step}"
        model_state, optimizer_state = self.strategy.full_state_dicts(self.model, self.optimizer)
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
        if resume_from_checkpoint is not True:  # the one asked for, or an error
            return self._resume_from(resume_from_checkpoint)
        found = ckpt.list_checkpoints(self.args.output_dir)
        if not found:
            raise ValueError(f"resume_from_checkpoint=True but {self.args.output_dir} has no complete checkpoint")
        # newest first; one that does not load (a corrupt file under a complete marker) is skipped
        failures = []
        for path in reversed(found):
            try:
                step = self._resume_from(path)
            except Exception as e:  # noqa: BLE001 - any file of it may be the broken one
                failures.append(f"{path.name}: {type(e).__name__}: {e}")
                print(f"warning: cannot resume from {path} ({type(e).__name__}: {e}); trying the "
                      "previous checkpoint", file=sys.stderr, flush=True)
                continue
            if failures:
                print(f"resumed from {path.name}, the newest checkpoint that loads",
                      file=sys.stderr, flush=True)
            return step
        raise ValueError(f"no checkpoint in {self.args.output_dir} could be loaded: "
                         + "; ".join(failures))

    def _resume_from(self, path) -> int:
        written = json.loads((Path(path) / ckpt.TRAINER_STATE).read_text())["config"].get("fsdp", False)
        if written != self.args.fsdp:  # the optimizer state is keyed differently (names vs indices)
            raise ValueError(f"{path} was written with fsdp={written}; resume it with fsdp={written}")
        if self.peft:  # the checkpoint holds the adapter, as peft saves it
            state = ckpt.load_checkpoint(path, None, self.optimizer, self.scheduler)
            lora.load_adapter(self.model, path)
        else:
            state = self.strategy.load_checkpoint(path, self.model, self.optimizer, self.scheduler)
        self.sampler.load_state_dict(state["sampler"])
        self.global_step = int(state["global_step"])
        self.state.log_history = list(state.get("log_history", []))
        self.generator.mark_stale()
        return self.global_step


def _disable_dropout(model: torch.nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
