"""`tandem train grpo`: GRPO with the engine colocated. With no model named, a demo run of the
embedded SmolLM2-135M-Instruct on the built-in arithmetic task: a few minutes' worth on a CPU,
a larger batch and more steps on a GPU (in bf16, the GPU default)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing

from tandem.rl.config import GRPOConfig

# The embedded-default demo: sizes a CPU finishes in minutes. Flags given on the command line win.
DEMO_OVERRIDES = dict(
    output_dir="runs/grpo-smollm2-arithmetic", num_generations=8, per_device_train_batch_size=16,
    gradient_accumulation_steps=1, max_completion_length=16, max_prompt_length=96, learning_rate=1e-5,
    max_steps=10, temperature=1.0, beta=0.0, logging_steps=1, save_steps=16, report_to=["jsonl"],
    gradient_checkpointing=False, lr_scheduler_type="constant",
)
# On a GPU the demo is sized to show learning: 64 x 8 completions a step, 60 steps (about a minute
# on an H200; held-out accuracy 18% -> ~45%).
GPU_DEMO_OVERRIDES = dict(DEMO_OVERRIDES, per_device_train_batch_size=64, max_completion_length=32,
                          max_steps=60, save_steps=60)
DEMO_EVAL_SAMPLES = {"cpu": 32, "cuda": 256}
ACCURACY = "accuracy_reward/mean"  # the reward component that is the arithmetic task's accuracy
_SKIP = {"chat_template_kwargs", "reward_weights", "report_to"}


def _type_of(tp):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return (args[0] if args else tp) if typing.get_origin(tp) else tp


def add_subcommands(sub) -> None:
    train = sub.add_parser("train", help="RL training with the engine colocated")
    train_sub = train.add_subparsers(dest="train_command", required=True)
    p = train_sub.add_parser("grpo", help="GRPO (TRL's GRPOConfig names)")
    p.add_argument("--model", default=None, help="local HF model dir (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dataset", default="arithmetic",
                   help="'arithmetic' (built in) or a local JSONL/Parquet file with a 'prompt' column")
    p.add_argument("--rewards", default="accuracy,short",
                   help="comma list of: accuracy, short (a one-line reply ending in a number), format "
                   "(<think>/<answer> tags), length (soft overlong punishment)")
    p.add_argument("--num-train-prompts", type=int, default=2000, help="size of the built-in task")
    p.add_argument("--eval-samples", type=int, default=None,
                   help="held-out prompts scored before and after (demo: 32 on a CPU, 256 on a GPU; else 32)")
    p.add_argument("--report-to", default=None, help="comma list: jsonl, tensorboard, none")
    p.add_argument("--resume", action="store_true", help="resume from the latest checkpoint in --output-dir")
    hints = typing.get_type_hints(GRPOConfig)
    for f in dataclasses.fields(GRPOConfig):
        if f.name in _SKIP:
            continue
        tp = _type_of(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        default_txt = f"(GRPOConfig default: {f.default})"
        if tp is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=default_txt)
        elif tp in (int, float, str):
            p.add_argument(flag, type=tp, default=None, help=default_txt)
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


def _main(args: argparse.Namespace) -> int:
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
    trainer = GRPOTrainer(model, _reward_funcs(args.rewards, config.max_completion_length), config,
                          train_dataset=train, eval_dataset=test)
    before = trainer.evaluate() if test is not None else {}
    start = trainer.global_step
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    after = trainer.evaluate() if test is not None else {}
    held_out = [(start, before[f"eval/{ACCURACY}"]), (trainer.global_step, after[f"eval/{ACCURACY}"])] \
        if f"eval/{ACCURACY}" in before else []
    curve = plot_reward_curve(config.output_dir, held_out=held_out,
                              accuracy_key=f"rewards/{ACCURACY}" if held_out else None)
    summary = {"held_out_before": before, "held_out_after": after, "steps": trainer.global_step,
               "reward_curve": curve, "output_dir": config.output_dir}
    if held_out:
        print(f"held-out accuracy (greedy, {eval_samples} problems): {100 * held_out[0][1]:.1f}% before, "
              f"{100 * held_out[1][1]:.1f}% after {trainer.global_step - start} steps; curves in {curve}")
    print(json.dumps(summary))
    return 0
