"""GRPOConfig: every GRPO training knob in one dataclass, named as TRL's GRPOConfig names them.

The CLI (`tandem train grpo`) reads its defaults from here; `__post_init__` checks the values and
derives `steps_per_generation` / `generation_batch_size` the way TRL does.
"""

from __future__ import annotations

import difflib
import math
import warnings
from dataclasses import asdict, dataclass, fields
from typing import Any

from tandem.rl import trl_compat

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo")
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
VLLM_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# transformers' get_scheduler names, less reduce_lr_on_plateau (it needs an eval metric).
LR_SCHEDULERS = ("constant", "linear", "cosine", "constant_with_warmup", "cosine_with_restarts",
                 "polynomial", "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr",
                 "warmup_stable_decay")
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw", "sgd", "adagrad", "rmsprop",
              # lighter state (transformers' names): torchao's, bitsandbytes' (`tandem.rl.optim`)
              "adamw_torch_8bit", "adamw_torch_4bit", "adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit")
VLLM_MODES = ("colocate", "server")
REPORT_TO = ("jsonl", "tensorboard")
STRATEGIES = ("no", "steps", "epoch")  # logging / eval / save, as transformers names them
FSDP_OPTIONS = ("full_shard", "auto_wrap")  # transformers' fsdp words that FSDP2 per layer is


@trl_compat.accepts_trl_fields
@dataclass
class GRPOConfig:
    """GRPO settings. Batch sizes count completions (prompts x num_generations), as in TRL.

    Also takes every other field of TRL's GRPOConfig / transformers' TrainingArguments
    (`tandem.rl.trl_compat`): ignored with a warning or refused with a message.
    """

    output_dir: str | None = "runs/grpo"  # None: "trainer_output", as transformers
    # A fresh run refuses an output_dir holding another run's checkpoints (resume it instead);
    # with this, that run's checkpoints and logged metrics are removed first (TRL's name).
    overwrite_output_dir: bool = False
    seed: int = 42
    data_seed: int | None = None  # None: seed; orders the prompts
    run_name: str | None = None  # recorded in trainer_state.json
    use_cpu: bool = False  # train on the CPU even where CUDA is present

    # How long: max_steps > 0 wins over num_train_epochs (TRL/HF semantics).
    max_steps: int = -1
    num_train_epochs: float = 1.0

    # Batching. One generation batch = generation_batch_size completions, consumed in
    # steps_per_generation micro-batches of per_device_train_batch_size completions.
    num_generations: int = 8
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    steps_per_generation: int | None = None  # None: gradient_accumulation_steps
    generation_batch_size: int | None = (
        None  # None: per_device_train_batch_size * steps_per_generation
    )
    num_iterations: int = 1  # mu: optimisation passes over each generation batch
    shuffle_dataset: bool = True

    # Lengths, in tokens. Prompts longer than max_prompt_length keep their last tokens.
    max_prompt_length: int | None = 512
    max_completion_length: int = 256
    chat_template_kwargs: dict[str, Any] | None = None
    model_init_kwargs: dict[str, Any] | None = None  # from_pretrained kwargs when model is a name
    trust_remote_code: bool = False

    # Sampling (vLLM SamplingParams semantics: top_k 0 and min_p 0 disable).
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    generation_kwargs: dict[str, Any] | None = None  # more SamplingParams (stop, ...), as TRL
    # TRL's: rollouts (and evaluation's greedy completions) match this regex, through the engine's
    # structured outputs (llguidance). As with vLLM, the engine's logprobs are those of the
    # grammar-masked distribution and the trainer scores the policy unmasked: where the grammar
    # forced a token, the importance ratio falls below 1 and vllm_importance_sampling_correction
    # weighs it down, as in TRL (vllm_importance_sampling_correction=False: no such weighting).
    vllm_structured_outputs_regex: str | None = None

    # Optimiser and schedule.
    learning_rate: float = 1e-6
    optim: str = "adamw_torch_fused"  # transformers' default; fused on CUDA (no full-size temporaries)
    # AdamW's state and step in host memory (`tandem.rl.offload`): 8 B a parameter less on the
    # device, the same arithmetic. None: only where the memory plan finds it does not fit there.
    optim_offload: bool | None = None
    lr_scheduler_type: str = "linear"
    lr_scheduler_kwargs: dict[str, Any] | None = None
    warmup_steps: int | float = 0  # >= 1: steps; in (0, 1): a share of the steps (transformers 5)
    warmup_ratio: float = 0.0  # used when warmup_steps is 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0  # 0 disables clipping
    # A step whose loss or gradient norm is not finite is skipped; this many in a row stop the run.
    max_consecutive_nonfinite_steps: int = 3
    # None: recompute only when one micro-batch's activations do not fit beside the rest of the
    # training phase (`tandem.rl.memory_plan`, printed before the first step); True / False force it.
    gradient_checkpointing: bool | None = None
    bf16: bool | None = None  # None: bf16 where the device supports it, else fp32
    disable_dropout: bool = False
    # TRL's switch for Liger: True means fused_kernels=True (unless that is set). tandem's logprobs
    # are its own chunked kernel (no [N, V] fp32 copy), which is what Liger's fused loss saves;
    # Liger itself is not used.
    use_liger_kernel: bool = False
    # tandem's fused Triton training kernels (RMSNorm, SwiGLU, rotary: one pass forward, one
    # backward) in this model's decoder layers instead of HF's elementwise ops and autocast's casts
    # (`tandem.rl.fused_layers`; the patch is per model instance); under bf16 also the Linears'
    # weight gradients accumulated in fp32 by their GEMM (`tandem.rl.grad_accum_linear`). None: on
    # when training on CUDA with Triton installed; True on a CPU needs TRITON_INTERPRET=1 (slow; tests).
    fused_kernels: bool | None = None
    # Each micro-batch's rows packed into one sequence (TRL's SFTConfig name): no FLOP on padding,
    # whatever the spread of completion lengths; same numbers as padded rows (`tandem.rl.packing`).
    padding_free: bool = False
    # With padding_free: the rows of one prompt (a GRPO group's G completions) packed with their
    # prompt once, the completions attending to its keys (`tandem.rl.packing`): G (P + C) tokens
    # cost P + G C, with the same numbers. None: on with padding_free.
    share_prompts: bool | None = None
    # The trainer's logprob values from the engine's own model code and batch-invariant kernels
    # (`tandem.rl.scorer`), the engine running them too: the two agree exactly in bf16 (|engine -
    # trainer logprob| 0, importance ratio 1 on-policy); the gradient still comes from the HF
    # forward. One more forward per micro-batch and slower generation (docs/rl-numerics.md).
    batch_invariant: bool = False
    # With padding_free: each optimizer step's rows grouped into micro-batches of at most this many
    # real tokens (prompt + completion), balanced, instead of per_device_train_batch_size rows
    # each (verl's use_dynamic_bsz + ppo_max_token_len_per_gpu). The loss and the gradients do not
    # change: every loss_type is normalised over the whole step (`tandem.rl.micro_batches`).
    max_tokens_per_micro_batch: int | None = None

    # Loss.
    beta: float = 0.0  # KL coefficient; 0 means no reference model is kept
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: epsilon (DAPO's clip-higher recommends 0.28)
    loss_type: str = "dapo"
    importance_sampling_level: str = "token"  # "sequence" is GSPO
    scale_rewards: str | bool = "group"  # True -> "group", False -> "none", as TRL accepts
    mask_truncated_completions: bool = False
    reward_weights: list[float] | None = None

    # Correction for the gap between the engine's sampling logprobs and the trainer's.
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_max: float | None = 3.0
    vllm_importance_sampling_clip_min: float | None = None
    vllm_importance_sampling_cap: float | None = None  # deprecated in TRL: sets clip_max

    # Generation engine: always tandem's (use_vllm=False, TRL's transformers generate, warns).
    use_vllm: bool = True
    vllm_mode: str = "colocate"
    vllm_server_base_url: str | None = None  # vllm_mode="server": the `tandem serve` to push to
    vllm_server_host: str = "0.0.0.0"  # with vllm_server_port: the URL when base_url is None
    vllm_server_port: int = 8000
    vllm_server_api_key: str | None = None
    # "auto": the KV cache one round needs, within what the generate phase leaves beside the
    # trainer's weights and optimizer state (`tandem.rl.memory_plan`); a share in (0, 1]: vLLM's.
    vllm_gpu_memory_utilization: float | str = "auto"
    # None: the memory plan decides: the engine stays awake through training where its weights and
    # KV cache fit beside the train phase (no release and re-map each step), else it sleeps at
    # engine_sleep_level; True / False force it (TRL's field).
    vllm_enable_sleep_mode: bool | None = None
    engine_sleep_level: int = 2  # 1: free KV cache only; 2: also drop engine-only weight copies
    vllm_tensor_parallel_size: int = 1  # only 1 colocated (see _check_engine)
    vllm_max_model_length: int | None = None

    # Data parallelism under torchrun. False: every rank keeps a full replica and gradients are
    # all-reduced. True: FSDP2 shards parameters, gradients and optimizer state over the ranks
    # (one unit per decoder layer; transformers' TrainingArguments.fsdp, version 2).
    fsdp: bool | str | list[str] | None = False  # TrainingArguments' "full_shard [auto_wrap]": True

    # Strategies, as transformers' TrainingArguments has them: "no", "steps" or "epoch". An
    # interval >= 1 counts optimizer steps; one in (0, 1) is a share of all steps.
    logging_strategy: str = "steps"
    logging_first_step: bool = False
    eval_strategy: str = "no"  # evaluates eval_dataset (greedy, reward functions) when not "no"
    eval_steps: int | float | None = None  # None: logging_steps
    eval_delay: float = 0
    eval_on_start: bool = False
    save_strategy: str = "steps"  # also: "no" skips the final save_model at the end of train()

    # Logging and checkpoints.
    logging_steps: int | float = 1
    report_to: list[str] | tuple[str, ...] | str = ("jsonl", "tensorboard")  # or "all", "none"
    log_completions: bool = False
    num_completions_to_print: int | None = 4
    save_steps: int | float = 500
    save_total_limit: int | None = None

    def _check_structured_outputs(self) -> None:
        from tandem.engine.structured_output import check_grammar
        from tandem.sampling_params import StructuredOutputsParams

        regex = self.vllm_structured_outputs_regex
        if not isinstance(regex, str) or not regex:
            raise ValueError(f"vllm_structured_outputs_regex must be a non-empty regex or None, got {regex!r}")
        if self.batch_invariant:
            raise ValueError("vllm_structured_outputs_regex masks the engine's distribution, which "
                             "batch_invariant=True's scorer does not follow: set one of them")
        try:
            check_grammar(StructuredOutputsParams(regex=regex))
        except ValueError as exc:
            raise ValueError(f"vllm_structured_outputs_regex={regex!r}: {exc}") from None

    def __post_init__(self) -> None:
        self._normalise_trl_values()
        self._check_batching()
        self._check_loss()
        self._check_importance_sampling()
        self._check_sampling()
        self._check_optimiser()
        self._check_engine()
        self._check_logging()

    # ---- checks, one group each ----------------------------------------------------------------

    def _normalise_trl_values(self) -> None:
        """Values TRL / transformers spell differently, turned into tandem's."""
        if self.output_dir is None:
            self.output_dir = "trainer_output"
        if self.min_p is None:
            self.min_p = 0.0
        if self.top_k is None:
            self.top_k = 0
        if self.fused_kernels is not None and not isinstance(self.fused_kernels, bool):
            raise ValueError(f"fused_kernels must be True, False or None (on where CUDA and Triton "
                             f"are), got {self.fused_kernels!r}")
        if not self.use_vllm:
            warnings.warn(
                "GRPOConfig: use_vllm=False is ignored: tandem always generates with its own engine "
                "(vllm_mode picks colocate or server)", UserWarning, stacklevel=4)
        fsdp = self.fsdp
        if fsdp is None or isinstance(fsdp, bool):
            self.fsdp = bool(fsdp)
        else:
            words = fsdp.split() if isinstance(fsdp, str) else [str(w) for w in fsdp]
            other = [w for w in words if w not in FSDP_OPTIONS]
            if other:
                raise ValueError(
                    f"fsdp={fsdp!r}: tandem's FSDP2 fully shards one unit per decoder layer "
                    f"('full_shard auto_wrap'); {', '.join(map(repr, other))} is not supported"
                )
            self.fsdp = bool(words)

    def _check_batching(self) -> None:
        _at_least(
            "num_generations",
            self.num_generations,
            2,
            "GRPO compares completions within a group, so it needs at least 2 per prompt",
        )
        _at_least("per_device_train_batch_size", self.per_device_train_batch_size, 1)
        _at_least("gradient_accumulation_steps", self.gradient_accumulation_steps, 1)
        _at_least("num_iterations", self.num_iterations, 1)
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            raise ValueError(
                "set only one of generation_batch_size and steps_per_generation; the other is "
                "derived from per_device_train_batch_size"
            )
        if self.generation_batch_size is not None:
            _at_least("generation_batch_size", self.generation_batch_size, 1)
            if self.generation_batch_size % self.per_device_train_batch_size:
                raise ValueError(
                    f"generation_batch_size ({self.generation_batch_size}) must be a multiple of "
                    f"per_device_train_batch_size ({self.per_device_train_batch_size})"
                )
            self.steps_per_generation = (
                self.generation_batch_size // self.per_device_train_batch_size
            )
        else:
            if self.steps_per_generation is None:
                self.steps_per_generation = self.gradient_accumulation_steps
            _at_least("steps_per_generation", self.steps_per_generation, 1)
            self.generation_batch_size = (
                self.per_device_train_batch_size * self.steps_per_generation
            )
        if self.generation_batch_size % self.num_generations:
            raise ValueError(
                f"generation_batch_size ({self.generation_batch_size} = "
                f"per_device_train_batch_size "
                f"{self.per_device_train_batch_size} x steps_per_generation "
                f"{self.steps_per_generation}) must be a multiple of num_generations "
                f"({self.num_generations}) so every prompt's group is whole; change "
                f"per_device_train_batch_size, steps_per_generation or num_generations"
            )
        if self.max_steps == 0 or self.max_steps < -1:
            raise ValueError(
                f"max_steps must be -1 (use num_train_epochs) or >= 1, got {self.max_steps}"
            )
        if self.max_steps == -1 and self.num_train_epochs <= 0:
            raise ValueError(
                f"num_train_epochs must be > 0 when max_steps is -1, got {self.num_train_epochs}"
            )
        if self.max_prompt_length is not None:
            _at_least("max_prompt_length", self.max_prompt_length, 1, "or None for no limit")
        _at_least("max_completion_length", self.max_completion_length, 1)
        self._check_token_budget()

    @property
    def shares_prompts(self) -> bool:
        return self.padding_free if self.share_prompts is None else self.share_prompts

    def _check_token_budget(self) -> None:
        if self.share_prompts and not self.padding_free:
            raise ValueError("share_prompts=True packs each prompt once into padding-free micro-batches and "
                             "needs padding_free=True (or leave share_prompts=None)")
        budget = self.max_tokens_per_micro_batch
        if budget is None:
            return
        _at_least("max_tokens_per_micro_batch", budget, 1, "or None for per_device_train_batch_size rows")
        if not self.padding_free:
            raise ValueError(
                f"max_tokens_per_micro_batch ({budget}) counts real tokens and needs "
                "padding_free=True: padded rows compute rows x the longest row, which the budget "
                "does not bound"
            )
        longest = (self.max_prompt_length or 0) + self.max_completion_length
        if self.max_prompt_length is not None and budget < longest:
            raise ValueError(
                f"max_tokens_per_micro_batch ({budget}) must be >= max_prompt_length + "
                f"max_completion_length ({longest}): a sequence is never split over micro-batches"
            )

    def _check_loss(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(_choice_msg("loss_type", self.loss_type, LOSS_TYPES))
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(
                _choice_msg(
                    "importance_sampling_level",
                    self.importance_sampling_level,
                    IMPORTANCE_SAMPLING_LEVELS,
                )
            )
        self.scale_rewards = {True: "group", False: "none"}.get(
            self.scale_rewards, self.scale_rewards
        )
        if self.scale_rewards not in SCALE_REWARDS:
            raise ValueError(_choice_msg("scale_rewards", self.scale_rewards, SCALE_REWARDS))
        if self.epsilon <= 0:
            raise ValueError(f"epsilon must be > 0 (0.2 is usual), got {self.epsilon}")
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        if self.epsilon_high <= 0:
            raise ValueError(f"epsilon_high must be > 0 (DAPO uses 0.28), got {self.epsilon_high}")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0 (0 disables the KL term), got {self.beta}")
        if self.reward_weights is not None:
            self.reward_weights = [float(w) for w in self.reward_weights]

    def _check_importance_sampling(self) -> None:
        if self.vllm_importance_sampling_cap is not None:
            warnings.warn(
                "vllm_importance_sampling_cap is deprecated (as in TRL); use "
                "vllm_importance_sampling_clip_max",
                FutureWarning,
                stacklevel=3,
            )
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
            self.vllm_importance_sampling_cap = None
        if self.vllm_importance_sampling_mode not in VLLM_IS_MODES:
            raise ValueError(
                _choice_msg(
                    "vllm_importance_sampling_mode",
                    self.vllm_importance_sampling_mode,
                    VLLM_IS_MODES,
                )
            )
        lo, hi = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if hi is not None and hi <= 0:
            raise ValueError(f"vllm_importance_sampling_clip_max must be > 0, got {hi}")
        if lo is not None and lo < 0:
            raise ValueError(f"vllm_importance_sampling_clip_min must be >= 0, got {lo}")
        if lo is not None and hi is not None and lo >= hi:
            raise ValueError(
                f"vllm_importance_sampling_clip_min ({lo}) must be < "
                f"vllm_importance_sampling_clip_max ({hi})"
            )
        if (
            self.vllm_importance_sampling_correction
            and lo is None
            and hi is None
            and self.vllm_importance_sampling_mode.endswith("_truncate")
        ):
            raise ValueError(
                "a *_truncate vllm_importance_sampling_mode needs "
                "vllm_importance_sampling_clip_max "
                "or vllm_importance_sampling_clip_min set"
            )

    def _check_sampling(self) -> None:
        if self.temperature <= 0:
            raise ValueError(
                f"temperature must be > 0 for GRPO (it samples), got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1.0 disables it), got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(
                f"repetition_penalty must be > 0 (1.0 disables it), got {self.repetition_penalty}"
            )
        if self.vllm_structured_outputs_regex is not None:
            self._check_structured_outputs()
        if self.batch_invariant:
            off = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}
            dropped = {k: getattr(self, k) for k, v in off.items() if getattr(self, k) != v}
            if dropped:
                raise ValueError(
                    f"batch_invariant=True scores tokens under softmax(logits / temperature); {dropped} "
                    "change the engine's distribution in ways its scorer does not follow: leave them at "
                    "their defaults, or set batch_invariant=False (the SamplingFilter path)")
            if self.vllm_mode != "colocate":
                raise ValueError(f"batch_invariant=True needs vllm_mode='colocate' (got {self.vllm_mode!r}): the "
                                 "scorer and the engine must run the same kernels in one process")

    def _check_optimiser(self) -> None:
        _at_least("max_consecutive_nonfinite_steps", self.max_consecutive_nonfinite_steps, 1)
        if self.learning_rate < 0:
            raise ValueError(f"learning_rate must be >= 0, got {self.learning_rate}")
        if self.optim not in OPTIMIZERS:
            raise ValueError(
                _choice_msg("optim", self.optim, OPTIMIZERS)
                + "; for any other optimizer pass GRPOTrainer(optimizers=(optimizer, scheduler))"
            )
        if self.optim_offload and self.optim not in ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw"):
            raise ValueError(
                f"optim_offload=True keeps AdamW's state in host memory; optim={self.optim!r} is not "
                "a 32-bit AdamW (use adamw_torch_fused, or optim_offload=False)")
        if self.optim_offload and self.fsdp:
            raise ValueError("optim_offload=True runs on one GPU's full replica; with fsdp=True the "
                             "shards already divide the optimizer state over the ranks")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.lr_scheduler_type not in LR_SCHEDULERS:
            raise ValueError(
                _choice_msg("lr_scheduler_type", self.lr_scheduler_type, LR_SCHEDULERS)
            )
        if not 0.0 <= self.warmup_ratio <= 1.0:
            raise ValueError(f"warmup_ratio must be in [0, 1], got {self.warmup_ratio}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        if self.adam_epsilon <= 0:
            raise ValueError(f"adam_epsilon must be > 0, got {self.adam_epsilon}")
        if self.max_grad_norm < 0:
            raise ValueError(
                f"max_grad_norm must be >= 0 (0 disables clipping), got {self.max_grad_norm}"
            )

    def _check_engine(self) -> None:
        if self.vllm_mode not in VLLM_MODES:
            raise ValueError(_choice_msg("vllm_mode", self.vllm_mode, VLLM_MODES))
        if self.vllm_mode == "server" and not self.vllm_server_base_url:
            # As TRL: base_url wins; else host and port.
            self.vllm_server_base_url = f"http://{self.vllm_server_host}:{self.vllm_server_port}"
        if self.fsdp and self.vllm_mode != "colocate":
            raise ValueError(
                "fsdp=True shards the colocated data-parallel trainer (each rank's engine gathers "
                "the weights); with vllm_mode='server' use fsdp=False"
            )
        util = self.vllm_gpu_memory_utilization
        if util != "auto" and (isinstance(util, str | bool) or not 0.0 < util <= 1.0):
            raise ValueError(
                "vllm_gpu_memory_utilization must be 'auto' (the memory plan sizes the KV cache) "
                f"or a share in (0, 1], got {util!r}"
            )
        if self.engine_sleep_level not in (1, 2):
            raise ValueError(
                f"engine_sleep_level must be 1 (free the KV cache) or 2 (also drop engine weight "
                f"copies), got {self.engine_sleep_level}"
            )
        _at_least("vllm_tensor_parallel_size", self.vllm_tensor_parallel_size, 1)
        if self.vllm_tensor_parallel_size != 1:
            raise ValueError(
                f"vllm_tensor_parallel_size={self.vllm_tensor_parallel_size}: the colocated engine "
                "runs on its trainer rank's GPU (1); for a tensor-parallel engine use "
                "vllm_mode='server' with `tandem serve --tensor-parallel-size N` on other GPUs"
            )
        if self.vllm_max_model_length is not None:
            _at_least("vllm_max_model_length", self.vllm_max_model_length, 1)

    def _check_logging(self) -> None:
        for name in ("logging_strategy", "eval_strategy", "save_strategy"):
            value = getattr(self, name)
            value = getattr(value, "value", value)  # transformers' IntervalStrategy enums
            setattr(self, name, value)
            if name == "save_strategy" and value == "best":
                raise ValueError(
                    "save_strategy='best' needs an eval metric to rank checkpoints; tandem has "
                    "none to pick by: use 'steps' and choose from the eval/reward log")
            if value not in STRATEGIES:
                raise ValueError(_choice_msg(name, value, STRATEGIES))
        if self.eval_steps is None:
            self.eval_steps = self.logging_steps
        for name in ("logging_steps", "save_steps", "eval_steps"):
            _interval(name, getattr(self, name))
        if self.save_total_limit is not None:
            _at_least("save_total_limit", self.save_total_limit, 1, "or None to keep all")
        if self.num_completions_to_print is not None:
            _at_least("num_completions_to_print", self.num_completions_to_print, 0)
        report = self.report_to
        if report is None:  # transformers 4's default: every integration there is (ours: both)
            report = "all"
        if isinstance(report, str):
            report = report.split(",")
        report = [r.strip() for r in report if r.strip()]
        if report in (["none"], []):
            report = []
        elif report == ["all"]:
            report = list(REPORT_TO)
        foreign = [r for r in report if r in trl_compat.FOREIGN_REPORTERS]
        if foreign:
            warnings.warn(
                f"report_to: tandem does not write to {', '.join(foreign)}; metrics go to "
                f"output_dir/metrics.jsonl (and TensorBoard with report_to='tensorboard')",
                UserWarning, stacklevel=4)
            report = [r for r in report if r not in foreign]
        for r in report:
            if r not in REPORT_TO:
                raise ValueError(_choice_msg("report_to entry", r, REPORT_TO + ("all", "none")))
        self.report_to = list(dict.fromkeys(report))

    # ---- conversions ---------------------------------------------------------------------------

    @property
    def prompts_per_generation(self) -> int:
        """Distinct prompts in one generation batch."""
        return self.generation_batch_size // self.num_generations

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GRPOConfig:
        """Build from a dict (a saved config, a YAML file); unknown keys are errors naming them."""
        known = {f.name for f in fields(cls)} | set(trl_compat.FIELDS)
        unknown = sorted(set(values) - known)
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, known, n=1)
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ValueError(f"unknown GRPOConfig field(s): {', '.join(hints)}")
        values = dict(values)
        # A saved config has derived both; keep the one that was derived from the other consistent.
        if (
            values.get("generation_batch_size") is not None
            and values.get("steps_per_generation") is not None
        ):
            values["generation_batch_size"] = None
        return cls(**values)


def _interval(name: str, value: float) -> None:
    """A step interval: an integer >= 1, or a share of all steps in (0, 1)."""
    if value is None or not (value >= 1 and float(value).is_integer() or 0 < value < 1):
        raise ValueError(
            f"{name} must be a whole number of steps >= 1 or a share of all steps in (0, 1), "
            f"got {value}"
        )


def resolve_interval(value: float, total_steps: int) -> int:
    """Steps between two events for an interval of `_interval`'s kind."""
    return int(value) if value >= 1 else max(1, math.ceil(value * total_steps))


def _at_least(name: str, value: int, minimum: int, hint: str = "") -> None:
    if value is None or value < minimum:
        raise ValueError(
            f"{name} must be >= {minimum}{' (' + hint + ')' if hint else ''}, got {value}"
        )


def _choice_msg(name: str, value: object, choices: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(str(value), choices, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}{hint}"
