"""`tandem bench rl`: seconds per GRPO step for tandem's colocated trainer and, with `--compare trl`,
TRL's GRPOTrainer (use_vllm=False: transformers `generate`) on the same model, prompts and batch.
`--compare colocate,server` times colocated data parallel against server mode on two GPUs
(rl_modes.py, where the exact command lines are).

Workload grpo-1.5b (docs/benchmarks.md): Qwen2.5-1.5B architecture, random weights, 32 prompts x 8
generations per step, 128 prompt tokens, 256 completion tokens, full fine-tune in bf16, beta 0.

`--completion-len-dist uniform:LO-HI` makes the completion lengths vary (grpo-1.5b-varlen): each
prompt draws one, seeded, and both trainers stop there exactly (rl_lengths.py: tandem by each
prompt's own max_tokens with ignore_eos; TRL, whose `generate` has one max_new_tokens per batch, by
a logits processor ending each row at its length, so `generate` still runs until the batch's
longest row ends). Without it TRL's completions end at max_completion_length or at a sampled EOS
(about one token in 150k with random weights), tandem's at completion_len (ignore_eos).
`--padding-free` and `--max-tokens-per-micro-batch` set tandem's GRPOConfig fields (TRL has no
padding-free GRPO: it keeps its padded micro-batches). Token counts, tokens/s and the train MFU
come from the real tokens each step had, not the padded shape. `--device cpu` runs tandem alone,
small, e.g. to try `--profile-train`.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import time
from dataclasses import asdict

import torch

from tandem.bench.report import add_output_args
from tandem.bench.rl_lengths import (
    TRLLengths,
    completion_lengths,
    completion_range,
    stop_at_drawn_lengths,
)
from tandem.bench.rl_workload import (
    CPU_SIZES,
    RLBenchConfig,
    batching,
    even_token_reward,
    model_and_data,
    float_or_word,
    grpo_kwargs,
)
from tandem.bench.roofline import device_ceilings


def tandem_args(cfg: RLBenchConfig):
    """tandem's GRPOConfig for the workload (built before any run, so a bad value fails first)."""
    from tandem.rl import GRPOConfig

    return GRPOConfig(**grpo_kwargs(cfg))


def run_tandem(cfg: RLBenchConfig) -> dict:
    from tandem.bench.gpu_monitor import GpuMonitor
    from tandem.bench.rl_memory import ENGINE_KWARGS, peft_config_of, plan_for
    from tandem.bench.rl_profile import profile_train_phase
    from tandem.rl import GRPOTrainer
    from tandem.rl.trainer import PHASES

    cuda = cfg.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        plan_for(cfg)  # from the config: a workload that cannot fit is refused before the model is built
    model, tok, data = model_and_data(cfg)
    peft_config = peft_config_of(cfg)
    engine_kwargs = dict(ENGINE_KWARGS)
    if cfg.num_scheduler_steps is not None:
        engine_kwargs["num_scheduler_steps"] = cfg.num_scheduler_steps
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    else:
        engine_kwargs |= {"device": "cpu", "cpu_kv_cache_space_gib": cfg.cpu_kv_cache_space_gib}
    trainer = GRPOTrainer(model, even_token_reward, tandem_args(cfg), train_dataset=data, processing_class=tok,
                          engine_kwargs=engine_kwargs, peft_config=peft_config)
    stop_at_drawn_lengths(trainer.llm, completion_lengths(cfg, data["prompt"], tok))
    trainer.step()  # warm-up
    steps, spans = [], []
    with GpuMonitor(enabled=cuda) as mon:
        for _ in range(cfg.steps):
            sync()
            t0 = time.perf_counter()
            m = trainer.step()
            sync()
            m["wall"] = time.perf_counter() - t0
            steps.append(m)
            spans.append(trainer.last_phase_spans)
    out = _summary([s["wall"] for s in steps], statistics.mean(s["completions/num_tokens"] for s in steps))
    out["breakdown_s"] = {k: statistics.median(s[f"time/{k}"] for s in steps) for k in PHASES}
    reward, train = spans[-1]["reward"], spans[-1]["train"]
    out["reward_inside_train"] = train[0] <= reward[0] and reward[1] <= train[1]
    out["gpu"] = mon.summary()
    # which phase leaves the GPU idle (NVML utilization of the samples inside each phase)
    out["gpu_util_by_phase"] = {k: mon.util_during([sp[k] for sp in spans]) for k in PHASES}
    out |= _train_phase(trainer, steps, out["breakdown_s"]["train"])
    if cfg.profile_train:
        out["profile_train"] = profile_train_phase(trainer, cfg.profile_train)
    if cuda:
        out["engine_memory"] = trainer.llm.memory_report()
        out["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30  # trainer + engine
    del trainer, model
    return out


def _train_phase(trainer, steps: list[dict], train_s: float) -> dict:
    """The train phase's tokens, micro-batches and model FLOPs utilisation: 6 N FLOPs a computed
    token (forward and backward: the rows' real tokens, a shared prompt once; padding and a
    recomputed forward are not useful work), N the parameters (a tied head counted once)."""
    a = trainer.args
    n_params = sum(p.numel() for p in trainer.model.parameters())
    tokens = statistics.median(s["train/tokens"] for s in steps) * a.num_iterations
    computed = statistics.median(s["train/computed_tokens"] for s in steps) * a.num_iterations
    peak = device_ceilings()[1] if trainer.device.type == "cuda" else None  # None: no MFU
    fill = [s["train/micro_batch_fill"] for s in steps if "train/micro_batch_fill" in s]
    return {
        "peak_flops": peak, "train_tokens": tokens, "train_computed_tokens": computed,
        "train_mfu": 6 * n_params * computed / train_s / peak if peak else None,
        "padding_free": a.padding_free, "share_prompts": a.shares_prompts,
        "max_tokens_per_micro_batch": a.max_tokens_per_micro_batch,
        "fused_kernels": trainer.fused_kernels,
        "num_scheduler_steps": trainer.llm.llm_engine.config.num_scheduler_steps,
        "micro_batches_per_step": statistics.median(s["train/micro_batches"] for s in steps),
        "micro_batch_fill": statistics.median(fill) if fill else None,
        "train_memory": {k: statistics.median(s[k] for s in steps) for k in steps[0] if k.startswith("memory/")},
        "memory_plan": trainer.memory_plan.format("memory plan"),
    }


def run_trl(cfg: RLBenchConfig, fast: bool = False) -> dict:
    """TRL's GRPOTrainer without vLLM: its defaults, or (`fast`) its fastest settings that run
    here: Liger's fused loss where liger-kernel is installed, no recompute."""
    from transformers import TrainerCallback
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    from tandem.bench.gpu_monitor import GpuMonitor

    model, tok, data = model_and_data(cfg)
    lengths = completion_lengths(cfg, data["prompt"], tok)
    forced = TRLLengths(model, lengths, tok.eos_token_id) if cfg.completion_len_dist else None
    kwargs = batching(cfg, completion_range(cfg)[1])
    if fast:
        kwargs["gradient_checkpointing"] = False
        kwargs["use_liger_kernel"] = importlib.util.find_spec("liger_kernel") is not None
    args = TRLConfig(output_dir="/tmp/trl-bench-rl", report_to="none", save_strategy="no", use_vllm=False,
                     disable_dropout=True, **kwargs)
    spans: list[tuple[float, float]] = []
    lengths_logged: list[float] = []  # TRL's completions/mean_length, one a step

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            torch.cuda.synchronize()
            spans.append((self.t0, time.perf_counter()))

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths_logged.append(logs["completions/mean_length"])

    mon = GpuMonitor()
    trainer = TRLTrainer(model=model, reward_funcs=even_token_reward, args=args, train_dataset=data,
                         processing_class=tok, callbacks=[StepTimer()])
    mon.start()
    trainer.train()
    mon.stop()
    steady = spans[1:]  # after the warm-up step, as tandem's
    # its measured completion lengths where it logs them (the timed steps'), else the drawn mean
    measured = lengths_logged[1 : len(spans)]
    mean_len = statistics.mean(measured) if measured else statistics.mean(lengths.values())
    out = _summary([end - start for start, end in steady], mean_len * cfg.num_prompts * cfg.num_generations)
    out["completion_tokens_measured"] = bool(measured)
    out["gpu"] = mon.summary(window=(steady[0][0], steady[-1][1]))  # the timed steps only
    out["liger"] = bool(kwargs.get("use_liger_kernel"))
    out["lengths_forced"] = None if forced is None else forced.calls > 0  # False: TRL's generate was not ours
    del trainer, model
    return out


def _summary(walls: list[float], completion_tokens: float) -> dict:
    wall = statistics.median(walls)
    return {"step_s_median": wall, "step_s": walls, "completion_tokens_per_step": completion_tokens,
            "completion_tokens_per_s": completion_tokens / wall}


def run(cfg: RLBenchConfig) -> dict:
    from tandem.bench.report import finish, make_report
    if cfg.memory_budget_gib is not None:  # the plan's (and the trainer's) device capacity
        import os

        from tandem.rl.memory_plan import BUDGET_ENV

        os.environ[BUDGET_ENV] = str(cfg.memory_budget_gib)
    if cfg.plan_only:
        from tandem.bench.rl_memory import plan_only

        return plan_only(cfg)

    if set(cfg.compare.split(",")) & {"colocate", "server"}:
        from tandem.bench.rl_modes import run_modes

        tandem_only = {"completion_len_dist": None, "padding_free": False, "share_prompts": None,
                       "max_tokens_per_micro_batch": None, "num_scheduler_steps": None,
                       "profile_train": None}
        given = [k for k, v in tandem_only.items() if getattr(cfg, k) != v]
        if given:
            raise ValueError(f"--compare colocate,server runs the fixed-length workload as it is; "
                             f"{', '.join('--' + k.replace('_', '-') for k in given)} apply to tandem vs TRL")
        return run_modes(cfg)
    names = [c for c in cfg.compare.split(",") if c]
    bad = [n for n in names if n not in ("trl", "trl-fast")]
    if bad:
        raise ValueError(f"--compare must name 'trl' and/or 'trl-fast', or be 'colocate,server'; got {bad}")
    if names and importlib.util.find_spec("trl") is None:
        raise ValueError("--compare trl needs TRL: pip install 'tandem[bench]' (or pip install trl)")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("bench rl times GPU training steps: it needs a CUDA GPU; on a CPU, `--device cpu` "
                         "runs a small version of tandem's step (`--compare colocate,server --device cpu`: both modes)")
    if cfg.device == "cpu" and names:
        raise ValueError("--compare trl runs on a GPU only; on a CPU leave --compare out (tandem alone)")
    tandem_args(cfg)  # a bad value fails before TRL's run, not after it
    results = {}
    for name in names + ["tandem"]:
        results[name] = run_tandem(cfg) if name == "tandem" else run_trl(cfg, fast=name == "trl-fast")
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    _print(results, cfg)
    report = make_report("rl", asdict(cfg), results)
    finish(report, cfg.output, cfg.print_json)
    return report


def _print(results: dict, cfg: RLBenchConfig) -> None:
    per_step = cfg.num_prompts * cfg.num_generations
    print(f"{'trainer':<9} {'s/step':>8} {'completion tok/s':>17} {'mean len':>9} {'GPU util':>9}")
    for name, r in results.items():
        busy = r["gpu"].get("util_mean") if r["gpu"].get("available") else None
        busy_s = f"{busy:.0f}%" if busy is not None else "-"
        mean_len = r["completion_tokens_per_step"] / per_step
        print(f"{name:<9} {r['step_s_median']:>8.2f} {r['completion_tokens_per_s']:>17,.0f} {mean_len:>9.1f} "
              f"{busy_s:>9}")
    print(_lengths_note(results, cfg))
    if "trl" in results:
        results["speedup_vs_trl"] = results["trl"]["step_s_median"] / results["tandem"]["step_s_median"]
        print(f"tandem step is {results['speedup_vs_trl']:.1f}x faster than TRL (use_vllm=False)")
    if "trl-fast" in results:
        results["speedup_vs_trl_fast"] = results["trl-fast"]["step_s_median"] / results["tandem"]["step_s_median"]
        print(f"tandem step is {results['speedup_vs_trl_fast']:.1f}x faster than TRL's fastest settings here "
              f"(no recompute, Liger {'on' if results['trl-fast']['liger'] else 'not installed'})")
    t = results["tandem"]
    inside = {"reward": " (inside train: scored while the first forward pass runs)"} if t.get("reward_inside_train") else {}
    print("tandem step breakdown (s): " + ", ".join(f"{k} {v:.2f}{inside.get(k, '')}"
                                                      for k, v in t["breakdown_s"].items()))
    mem = t["train_memory"]
    plan = f", plan {mem['memory/plan_train_gib']:.1f}" if "memory/plan_train_gib" in mem else ""
    mfu = (f"MFU {100 * t['train_mfu']:.1f}% (6 x params x computed tokens / {t['peak_flops'] / 1e12:.0f} TFLOP/s)"
           if t["train_mfu"] is not None else "MFU unknown (no known peak for this device)")
    budget = t["max_tokens_per_micro_batch"]
    split = (f"{t['micro_batches_per_step']:g} micro-batches a step of <= {budget:,} tokens, "
             f"{100 * t['micro_batch_fill']:.0f}% full" if budget else
             f"{t['micro_batches_per_step']:g} micro-batches a step of {cfg.micro_batch} rows")
    shared = (f", {t['train_computed_tokens']:,.0f} computed (each prompt once a micro-batch)"
              if t["share_prompts"] else "")
    print(f"tandem train phase: {t['breakdown_s']['train']:.2f} s for {t['train_tokens']:,.0f} real tokens "
          f"(prompt + completion){shared}, {mfu}; padding-free {'on' if t['padding_free'] else 'off'}, {split}; "
          f"recompute {'on' if mem.get('memory/recompute') else 'off'}"
          + (f"; peak {mem['memory/train_peak_gib']:.1f} GiB{plan} (resident {mem['memory/train_resident_gib']:.1f})"
             if "memory/train_peak_gib" in mem else ""))
    if "memory/plan_train_gib" in mem:
        from tandem.rl.memory_table import format_measured

        print("tandem memory per phase (GiB), the plan's steady state beside the timed steps' medians:")
        print(format_measured(mem))
    by_phase = {k: v for k, v in t["gpu_util_by_phase"].items() if v is not None}
    if by_phase:
        print("tandem GPU utilization by phase: " + ", ".join(f"{k} {v:.0f}%" for k, v in by_phase.items()))
    if "profile_train" in t:
        p = t["profile_train"]
        print(f"tandem train-phase profile (one more step, {p['train_s']:.2f} s under the profiler) written to "
              f"{p['file']}, sorted by {p['sort_by']}")


def _lengths_note(results: dict, cfg: RLBenchConfig) -> str:
    """What the completion lengths were, for each trainer, in words."""
    lo, hi = completion_range(cfg)
    if cfg.completion_len_dist is None:
        note = f"completion lengths: {hi} tokens each (tandem: ignore_eos"
        trl = "; TRL: up to max_completion_length, ending early at a sampled EOS"
    else:
        note = (f"completion lengths: drawn per prompt, uniform {lo}-{hi} (seed {cfg.seed}); tandem stops each "
                "prompt's completions there (its own max_tokens, ignore_eos")
        trl = ("; TRL's generate ends each row there (a logits processor forces EOS, counted as a token) but "
               "runs every batch until its longest row ends")
    trls = [r for n, r in results.items() if n != "tandem"]
    if not trls:
        return note + ")"
    if any(r["lengths_forced"] is False for r in trls):
        trl = "; TRL did NOT go through the length processor: its completions ran to a sampled EOS or " \
              f"max_completion_length ({hi}), see its mean length"
    if not all(r["completion_tokens_measured"] for r in trls):
        trl += " (TRL logged no completion lengths: its tokens/s assume the drawn ones)"
    return note + trl + ")"


_HELP = {
    "model": "architecture preset or HF model dir (its architecture; the weights stay random)",
    "num_prompts": "prompts per step", "num_generations": "completions per prompt",
    "prompt_len": "prompt tokens", "completion_len": "completion tokens (tandem: ignore_eos)",
    "micro_batch": "completions per micro-batch", "steps": "timed steps (after one warm-up step)",
    "sleep_level": "the engine's sleep level between rollouts (1: KV cache, 2: also weights)",
    "seed": "random seed", "cpu_kv_cache_space_gib": "--device cpu: each engine's KV cache (GiB)",
    "lora_r": "> 0: train a LoRA adapter of this rank on every linear layer (peft), not all weights",
}


def _help(name: str, d: RLBenchConfig) -> str:
    text = f"{_HELP[name]} (default: {getattr(d, name)}"
    return text + (f"; {CPU_SIZES[name]} with --device cpu)" if name in CPU_SIZES else ")")


def add_parser(subparsers) -> None:
    d = RLBenchConfig()
    p = subparsers.add_parser("rl", help="GRPO step time (grpo-1.5b): tandem vs TRL, colocate vs server",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help=_help("model", d))
    p.add_argument("--compare", default=d.compare,
                   help="trl (TRL's defaults) and/or trl-fast (its fastest settings here): TRL's "
                   "GRPOTrainer beside tandem's (TRL is in the bench extra); colocate,server: colocated "
                   "data parallel vs server mode on two devices")
    add_output_args(p)
    p.add_argument("--device", choices=("cuda", "cpu"), default=d.device,
                   help="cpu: tandem's step alone (or, with --compare colocate,server, both modes) on the "
                   "CPU, small")
    p.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=d.fsdp,
                   help="colocate mode: FSDP2-sharded trainers instead of replicas")
    p.add_argument("--server-gpu-memory-utilization", type=float, default=d.server_gpu_memory_utilization,
                   help="server mode: the server's share of its GPU")
    p.add_argument("--server-timeout-s", type=float, default=d.server_timeout_s,
                   help="seconds for `tandem serve` to load and listen")
    p.add_argument("--cpu-kv-cache-space-gib", type=float, default=None, help=_help("cpu_kv_cache_space_gib", d))
    for f in ("num_prompts", "num_generations", "prompt_len", "completion_len", "micro_batch", "steps",
              "sleep_level", "seed", "lora_r"):
        p.add_argument("--" + f.replace("_", "-"), type=int, default=None if f in CPU_SIZES else getattr(d, f),
                       help=_help(f, d))
    p.add_argument("--gpu-memory-utilization", type=float_or_word, default=d.gpu_memory_utilization,
                   help="the colocated engine's share of GPU memory, or auto: the trainer's memory plan "
                   "sizes its KV cache (default: auto)")
    p.add_argument("--optim", default=d.optim,
                   help="the trainer's optimizer, by transformers' name (adamw_torch_8bit / adamw_torch_4bit: "
                   "torchao's quantised AdamW, for the largest models; default: %(default)s)")
    p.add_argument("--plan-only", action="store_true",
                   help="print the trainer's memory plan for this workload (bytes per phase, the choices, "
                   "or the smallest change that fits) and stop: nothing is loaded or allocated")
    p.add_argument("--memory-budget-gib", type=float, default=None,
                   help="the device capacity the memory plan assumes (TANDEM_MEMORY_BUDGET_GIB; default: "
                   "what the GPU has free; --plan-only without a GPU needs it)")
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction,
                   default=d.gradient_checkpointing,
                   help="force recompute on or off (default: tandem's memory plan decides; TRL recomputes)")
    p.add_argument("--completion-len-dist", default=d.completion_len_dist, metavar="uniform:LO-HI",
                   help="each prompt's completions run to a length drawn from LO-HI (seeded by --seed), "
                   "for both trainers, instead of --completion-len for all (default: off)")
    p.add_argument("--padding-free", action=argparse.BooleanOptionalAction, default=d.padding_free,
                   help="tandem: pack each micro-batch's rows into one sequence (GRPOConfig.padding_free)")
    p.add_argument("--share-prompts", action=argparse.BooleanOptionalAction, default=d.share_prompts,
                   help="tandem: with --padding-free, each prompt packed once with its completions "
                   "(GRPOConfig.share_prompts; default: on with --padding-free)")
    p.add_argument("--num-scheduler-steps", type=int, default=d.num_scheduler_steps, metavar="N",
                   help="tandem: decode steps its engine runs per scheduling round "
                   "(EngineConfig.num_scheduler_steps; default: the engine's)")
    p.add_argument("--fused-kernels", action=argparse.BooleanOptionalAction, default=d.fused_kernels,
                   help="tandem: its fused Triton RMSNorm/SwiGLU/rotary training kernels "
                   "(GRPOConfig.fused_kernels; default: on with CUDA)")
    p.add_argument("--max-tokens-per-micro-batch", type=int, default=d.max_tokens_per_micro_batch, metavar="N",
                   help="tandem: micro-batches of at most N real tokens instead of --micro-batch rows "
                   "(GRPOConfig.max_tokens_per_micro_batch; needs --padding-free)")
    p.add_argument("--profile-train", default=d.profile_train, metavar="FILE",
                   help="after the timed steps, profile one more step's train phase (torch.profiler) and "
                   "write its operator table, sorted by device time, to FILE")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    kw = {k: v for k, v in vars(args).items() if k in RLBenchConfig.__dataclass_fields__}
    sizes = CPU_SIZES if args.device == "cpu" else {}
    for name in CPU_SIZES:
        if kw.get(name) is None:
            kw[name] = sizes.get(name, getattr(RLBenchConfig, name))
    run(RLBenchConfig(**kw))
    return 0
