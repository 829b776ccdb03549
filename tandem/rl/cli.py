"""`tandem train grpo`: GRPO with the engine colocated. With no model named, a demo run of the
embedded SmolLM2-135M-Instruct on the built-in arithmetic task: a few minutes' worth on a CPU,
a larger batch and more steps on a GPU (in bf16, the GPU default)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import typing

from tandem.rl.config import GRPOConfig

# The embedded-default demo: sizes a CPU finishes in minutes. Flags given on the command line win.
DEMO_OVERRIDES = dict(
    output_dir="runs/grpo-smollm2-arithmetic", num_generations=8, per_device_train_batch_size=16,
    gradient_accumulation_steps=1, max_completion_length=16, max_prompt_length=96, learning_rate=1e-5,
    max_steps=10, temperature=1.0, beta=0.0, logging_steps=1, save_steps=16, report_to=["jsonl"],
    gradient_checkpointing=False, lr_scheduler_type="constant",
)
# On a GPU the demo is sized to show learning: 60 optimizer steps, each over 4 micro-batches of 64
# completions (32 prompts x 8), with batch-invariant kernels so the engine's and the trainer's
# logprobs agree exactly (tandem.batch_invariant). About two minutes on an H200.
GPU_DEMO_OVERRIDES = dict(DEMO_OVERRIDES, per_device_train_batch_size=64, gradient_accumulation_steps=4,
                          max_completion_length=32, max_steps=60, save_steps=60, batch_invariant=True)
DEMO_EVAL_SAMPLES = {"cpu": 32, "cuda": 256}
ACCURACY = "accuracy_reward/mean"  # the reward component that is the arithmetic task's accuracy
# each built-in reward's bounds, for the summary
REWARD_RANGES = {"accuracy": (0, 1), "short": (0, 1), "format": (0, 1), "length": (-1, 0)}
_SKIP = {"chat_template_kwargs", "reward_weights", "report_to"}
# one line per GRPOConfig field (TRL's names and meanings); the default is appended by the CLI
FIELD_HELP = {
    "output_dir": "checkpoints, metrics.jsonl, TensorBoard logs and the reward curve go here",
    "overwrite_output_dir": "a fresh run may replace another run's checkpoints and metrics there",
    "seed": "random seed (data order, sampling, the built-in task)",
    "max_steps": "optimizer steps to run; > 0 wins over --num-train-epochs",
    "num_train_epochs": "passes over the dataset (when --max-steps is -1)",
    "num_generations": "completions per prompt (the group GRPO compares within)",
    "per_device_train_batch_size": "completions per micro-batch",
    "gradient_accumulation_steps": "micro-batches per optimizer step",
    "steps_per_generation": "micro-batches per generation batch (default: --gradient-accumulation-steps)",
    "generation_batch_size": "completions generated at once (default: batch size x steps per generation)",
    "num_iterations": "optimisation passes over each generation batch (mu)",
    "shuffle_dataset": "shuffle the prompts",
    "max_prompt_length": "prompt tokens kept (the last ones)",
    "max_completion_length": "most tokens per completion",
    "temperature": "sampling temperature of the rollouts",
    "top_p": "rollouts' top-p",
    "top_k": "rollouts' top-k (0: off)",
    "min_p": "rollouts' min-p (0: off)",
    "repetition_penalty": "rollouts' repetition penalty (1: off)",
    "learning_rate": "AdamW learning rate",
    "lr_scheduler_type": "constant | linear | cosine",
    "warmup_ratio": "share of the steps spent warming the learning rate up",
    "weight_decay": "AdamW weight decay",
    "adam_beta1": "AdamW beta1",
    "adam_beta2": "AdamW beta2",
    "adam_epsilon": "AdamW epsilon",
    "max_grad_norm": "gradient clipping norm (0: off)",
    "max_consecutive_nonfinite_steps": "non-finite steps in a row (each skipped) that stop the run",
    "gradient_checkpointing": "recompute activations in backward (less memory, slower)",
    "bf16": "train in bf16 (default: where the device supports it)",
    "beta": "KL coefficient (0: no reference model)",
    "epsilon": "clip range of the policy ratio",
    "epsilon_high": "upper clip range (default: --epsilon; DAPO suggests 0.28)",
    "loss_type": "grpo | dapo | dr_grpo | bnpo",
    "importance_sampling_level": "token | sequence (GSPO)",
    "scale_rewards": "group | batch | none: what the advantages are divided by",
    "mask_truncated_completions": "leave completions cut at the length limit out of the loss",
    "vllm_importance_sampling_correction": "correct for the engine's and the trainer's logprob gap",
    "vllm_importance_sampling_mode": "token_truncate | token_mask | sequence_truncate | sequence_mask",
    "vllm_importance_sampling_clip_max": "upper bound of the correction ratio",
    "vllm_importance_sampling_clip_min": "lower bound of the correction ratio",
    "vllm_importance_sampling_cap": "deprecated in TRL: sets the clip max",
    "vllm_mode": "colocate (the engine in this process) | server (a `tandem serve` elsewhere)",
    "vllm_server_base_url": "--vllm-mode server: the server's URL",
    "vllm_server_api_key": "--vllm-mode server: its API key",
    "vllm_gpu_memory_utilization": "auto (the memory plan sizes the KV cache) or the share of GPU "
    "memory the colocated engine may take",
    "optim_offload": "AdamW's state and step in host memory (--no-optim-offload: never)",
    "vllm_enable_sleep_mode": "the engine sleeps while the trainer steps (releasing its weights and KV cache)",
    "engine_sleep_level": "1: free the KV cache; 2: also drop engine-only weight copies",
    "vllm_tensor_parallel_size": "GPUs the engine shards the model over",
    "vllm_max_model_length": "the engine's context length (default: prompt + completion)",
    "fsdp": "under torchrun: shard with FSDP2 instead of keeping replicas",
    "logging_steps": "print the compact line (and write metrics) every this many steps",
    "log_completions": "print a table of sample completions and their rewards",
    "num_completions_to_print": "rows of that table",
    "save_steps": "checkpoint every this many steps",
    "save_total_limit": "checkpoints kept (default: all)",
    "data_seed": "seed of the data order (default: --seed)",
    "run_name": "a name for the run (kept in the config)",
    "use_cpu": "train on the CPU even where there is a GPU",
    "trust_remote_code": "allow a model dir's own Python code",
    "optim": "adamw_torch | adamw_torch_fused | adamw_hf | sgd | adagrad | rmsprop | adamw_torch_8bit | "
    "adamw_torch_4bit (torchao) | adamw_bnb_8bit | paged_adamw_8bit (bitsandbytes)",
    "warmup_steps": "learning-rate warm-up steps",
    "disable_dropout": "turn the model's dropout off",
    "padding_free": "pack each micro-batch's rows into one sequence: no FLOP on padding",
    "share_prompts": "with --padding-free: each prompt's rows packed with the prompt once "
    "(same numbers, fewer tokens)",
    "batch_invariant": "engine and trainer score tokens with the same batch-invariant kernels: "
    "identical logprobs in bf16 (slower)",
    "max_tokens_per_micro_batch": "with --padding-free: micro-batches of at most this many real "
    "tokens, balanced, instead of --per-device-train-batch-size rows (same loss and gradients)",
    "use_liger_kernel": "TRL's name: means --fused-kernels (tandem's logprobs use its own chunked kernel)",
    "fused_kernels": "tandem's fused Triton RMSNorm/SwiGLU/rotary kernels (forward and backward) in "
    "the trained model, and under bf16 its Linears' weight gradients accumulated in fp32 by their GEMM "
    "(default: on with CUDA and Triton)",
    "use_vllm": "accepted for TRL scripts: tandem's engine always generates (False warns)",
    "vllm_server_host": "--vllm-mode server: the server's host (when no --vllm-server-base-url)",
    "vllm_server_port": "--vllm-mode server: the server's port",
    "logging_strategy": "steps | epoch | no: when to log",
    "logging_first_step": "also log the first step",
    "eval_strategy": "no | steps | epoch: when to score the held-out set during training",
    "eval_steps": "evaluate every this many steps (default: --logging-steps)",
    "eval_delay": "steps (or epochs) before the first evaluation",
    "eval_on_start": "evaluate before the first step",
    "save_strategy": "steps | epoch | no: when to checkpoint",
}


NONE_MEANS = {"gradient_checkpointing": "the trainer's memory plan decides",
              "share_prompts": "on with --padding-free",
              "optim_offload": "the trainer's memory plan decides",
              "vllm_enable_sleep_mode": "the trainer's memory plan decides"}


def _default_text(name: str, default) -> str:
    """The default a run gets: the demo's where it differs (no --model: CPU and GPU sizes)."""
    if name not in DEMO_OVERRIDES:
        if default is None:
            return f"(default: {NONE_MEANS[name]})" if name in NONE_MEANS else ""
        return f"(default: {default})"
    cpu, gpu = DEMO_OVERRIDES[name], GPU_DEMO_OVERRIDES[name]
    default = NONE_MEANS.get(name, default) if default is None else default
    if cpu == gpu == default:
        return f"(default: {default})"
    demo = f"{cpu}" if cpu == gpu else f"{cpu} on a CPU, {gpu} on a GPU"
    return f"(default: {default}; the demo without --model: {demo})"


def _type_of(tp):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if float in args and str in args:  # a share or a word ("auto")
        return float_or_word
    return (args[0] if args else tp) if typing.get_origin(tp) else tp


def float_or_word(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def add_subcommands(sub) -> None:
    train = sub.add_parser("train", help="RL training with the engine colocated")
    train_sub = train.add_subparsers(dest="train_command", required=True)
    p = train_sub.add_parser(
        "grpo", help="GRPO (TRL's GRPOConfig names)",
        description="GRPO with the engine colocated, flags named as TRL's GRPOConfig. Without "
        "--model: a demo on the embedded SmolLM2-135M-Instruct and the built-in arithmetic task, "
        "sized for the device (defaults below say where the demo differs).")
    p.add_argument("--model", default=None,
                   help="local HF model dir or .gguf file (default: the embedded SmolLM2-135M-Instruct, "
                   "the demo)")
    p.add_argument("--dataset", default="arithmetic",
                   help="'arithmetic' (built in) or a local JSONL/JSON/Parquet/CSV file (or a folder of them) "
                   "with a 'prompt' column")
    p.add_argument("--rewards", default="accuracy,short",
                   help="comma list of: accuracy, short (a one-line reply ending in a number), format "
                   "(<think>/<answer> tags), length (soft overlong punishment)")
    p.add_argument("--num-train-prompts", type=int, default=2000, help="size of the built-in task")
    p.add_argument("--eval-samples", type=int, default=None,
                   help="built-in task: held-out problems scored (greedy) before and after training "
                   f"(default: {DEMO_EVAL_SAMPLES['cpu']} on a CPU, {DEMO_EVAL_SAMPLES['cuda']} on a GPU)")
    p.add_argument("--report-to", default=None,
                   help="comma list: jsonl, tensorboard, none (default: jsonl,tensorboard; the demo: jsonl)")
    p.add_argument("--resume", action="store_true", help="resume from the latest checkpoint in --output-dir")
    hints = typing.get_type_hints(GRPOConfig)
    for f in dataclasses.fields(GRPOConfig):
        if f.name in _SKIP:
            continue
        tp = _type_of(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        text = FIELD_HELP.get(f.name, f.name.replace("_", " "))
        help_ = f"{text} {_default_text(f.name, f.default)}"
        if tp is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif tp in (int, float, str, float_or_word):
            p.add_argument(flag, type=tp, default=None, help=help_)
    p.set_defaults(func=_main)


def _reward_funcs(names: str, max_completion_length: int):
    from tandem.rl import rewards

    table = {
        "accuracy": lambda: rewards.accuracy_reward,
        "format": lambda: rewards.make_format_reward(),
        "short": lambda: rewards.short_answer_reward,
        "length": lambda: rewards.get_soft_overlong_punishment(max_completion_length, max_completion_length // 4),
    }
    funcs = []
    for name in [n for n in names.split(",") if n]:
        if name not in table:
            raise ValueError(f"--rewards: unknown reward {name!r}; choose from {sorted(table)}")
        funcs.append(table[name]())
    return funcs


def _check_paths(args: argparse.Namespace) -> None:
    """The mistakes a person makes first, refused before anything loads."""
    import os

    from tandem.engine.arg_utils import check_model_arg

    check_model_arg(args.model)
    if args.dataset != "arithmetic" and not os.path.exists(args.dataset):
        raise ValueError(f"--dataset: nothing at {args.dataset!r}; give 'arithmetic' (built in) or a "
                         "local JSONL/JSON/Parquet/CSV file (or a folder of them) with a 'prompt' column")


def _main(args: argparse.Namespace) -> int:
    _check_paths(args)
    from tandem.rl.data import arithmetic_dataset
    from tandem.rl.plot import plot_reward_curve
    from tandem.rl.trainer import GRPOTrainer

    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(GRPOConfig)
             if getattr(args, f.name, None) is not None}
    if args.report_to is not None:
        given["report_to"] = args.report_to.split(",")
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    demo = GPU_DEMO_OVERRIDES if device == "cuda" else DEMO_OVERRIDES
    values = dict(demo) if args.model is None else {}
    values.update(given)
    config = GRPOConfig(**values)
    reward_funcs = _reward_funcs(args.rewards, config.max_completion_length)
    eval_samples = args.eval_samples if args.eval_samples is not None else DEMO_EVAL_SAMPLES[device]
    model = args.model
    if model is None:
        from tandem.models import gguf

        model = str(gguf.converted_dir(gguf.default_gguf_path()))
    if args.dataset == "arithmetic":
        train = arithmetic_dataset(args.num_train_prompts, seed=config.seed, split="train")
        test = arithmetic_dataset(eval_samples, seed=config.seed, split="test") if eval_samples else None
    else:
        train, test = args.dataset, None
    say = functools.partial(print, file=sys.stderr, flush=True)
    say(f"loading {args.model or 'the embedded SmolLM2-135M-Instruct'} and the engine ({device}) ...")
    trainer = GRPOTrainer(model, reward_funcs, config, train_dataset=train, eval_dataset=test)
    if test is not None:
        say(f"scoring {eval_samples} held-out problems (greedy) before training ...")
    before = trainer.evaluate() if test is not None else {}
    start = trainer.global_step
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    if test is not None:
        say(f"scoring the {eval_samples} held-out problems again ...")
    after = trainer.evaluate() if test is not None else {}
    held_out = [(start, before[f"eval/{ACCURACY}"]), (trainer.global_step, after[f"eval/{ACCURACY}"])] \
        if f"eval/{ACCURACY}" in before else []
    curve = plot_reward_curve(config.output_dir, held_out=held_out,
                              accuracy_key=f"rewards/{ACCURACY}" if held_out else None)
    summary = {"held_out_before": before, "held_out_after": after, "steps": trainer.global_step,
               "reward_curve": curve, "output_dir": config.output_dir}
    lines = summary_lines(args.rewards, eval_samples, held_out, before, after, curve, config.output_dir)
    print("\n".join(lines))
    print(json.dumps(summary))
    return 0


def summary_lines(rewards: str, eval_samples: int, held_out: list, before: dict, after: dict,
                  curve: str | None, output_dir: str) -> list[str]:
    """The end of a run in words: accuracy before and after, what the reward adds up, where to look."""
    names = [n for n in rewards.split(",") if n]
    lines = []
    if held_out:
        (s0, a0), (s1, a1) = held_out
        lines.append(f"held-out accuracy (greedy, {eval_samples} problems): {100 * a0:.1f}% before, "
                     f"{100 * a1:.1f}% after {s1 - s0} steps ({100 * (a1 - a0):+.1f} points)")
    if "eval/reward" in after:
        ranges = {n: REWARD_RANGES.get(n, (0, 1)) for n in names}
        each = ", ".join(f"{n} in [{lo}, {hi}]" for n, (lo, hi) in ranges.items())
        lines.append(f"held-out reward {before.get('eval/reward', float('nan')):.2f} -> "
                     f"{after['eval/reward']:.2f}: the sum of {' + '.join(names)} ({each}), "
                     f"at most {sum(hi for _, hi in ranges.values())}")
    lines.append(f"metrics: {output_dir}/metrics.jsonl" + (f"; curves: {curve}" if curve else ""))
    return lines
