"""`tandem bench rl`: seconds per GRPO step for tandem's colocated trainer and, with `--compare trl`,
TRL's GRPOTrainer (use_vllm=False: transformers `generate`) on the same model, prompts and batch.
`--compare colocate,server` times colocated data parallel against server mode on two GPUs
(rl_modes.py, where the exact command lines are).

Workload grpo-1.5b (docs/benchmarks.md): Qwen2.5-1.5B architecture, random weights, 32 prompts x 8
generations per step, 128 prompt tokens, 256 completion tokens, full fine-tune in bf16, beta 0.
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
from tandem.bench.rl_workload import (
    CPU_SIZES,
    RLBenchConfig,
    batching,
    even_token_reward,
    float_or_word,
    grpo_kwargs,
    model_and_data,
)
from tandem.bench.roofline import device_ceilings


def run_tandem(cfg: RLBenchConfig) -> dict:
    from tandem.bench.gpu_monitor import GpuMonitor
    from tandem.bench.rl_memory import ENGINE_KWARGS, peft_config_of, plan_for
    from tandem.rl import GRPOConfig, GRPOTrainer
    from tandem.rl.trainer import PHASES

    plan_for(cfg)  # from the config: a workload that cannot fit is refused before the model is built
    model, tok, data = model_and_data(cfg)
    args = GRPOConfig(**grpo_kwargs(cfg))
    peft_config = peft_config_of(cfg)
    torch.cuda.reset_peak_memory_stats()
    trainer = GRPOTrainer(model, even_token_reward, args, train_dataset=data, processing_class=tok,
                          engine_kwargs=dict(ENGINE_KWARGS), peft_config=peft_config)
    trainer.step()  # warm-up
    steps, spans = [], []
    with GpuMonitor() as mon:
        for _ in range(cfg.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            m = trainer.step()
            torch.cuda.synchronize()
            m["wall"] = time.perf_counter() - t0
            steps.append(m)
            spans.append(trainer.last_phase_spans)
    out = _summary(steps, cfg)
    out["breakdown_s"] = {k: statistics.median(s[f"time/{k}"] for s in steps) for k in PHASES}
    out["gpu"] = mon.summary()
    # which phase leaves the GPU idle (NVML utilization of the samples inside each phase)
    out["gpu_util_by_phase"] = {k: mon.util_during([sp[k] for sp in spans]) for k in PHASES}
    # The train phase's model FLOPs utilisation: 6 N FLOPs a token (forward and backward; a
    # recomputed forward is not useful work), N the parameters (a tied head counted once).
    n_params = sum(p.numel() for p in trainer.model.parameters())
    train_tokens = cfg.num_prompts * cfg.num_generations * (cfg.prompt_len + cfg.completion_len)
    peak = device_ceilings()[1]  # None where this GPU's peak is not known: no MFU then
    out["peak_flops"] = peak
    out["train_mfu"] = 6 * n_params * train_tokens / out["breakdown_s"]["train"] / peak if peak else None
    out["train_memory"] = {k: statistics.median(s[k] for s in steps) for k in steps[0] if k.startswith("memory/")}
    out["memory_plan"] = trainer.memory_plan.format("memory plan")
    out["engine_memory"] = trainer.llm.memory_report()
    out["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30  # trainer + engine
    del trainer, model
    return out


def run_trl(cfg: RLBenchConfig, fast: bool = False) -> dict:
    """TRL's GRPOTrainer without vLLM: its defaults, or (`fast`) its fastest settings that run
    here: Liger's fused loss where liger-kernel is installed, no recompute."""
    from transformers import TrainerCallback
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    from tandem.bench.gpu_monitor import GpuMonitor

    model, tok, data = model_and_data(cfg)
    kwargs = batching(cfg)
    if fast:
        kwargs["gradient_checkpointing"] = False
        kwargs["use_liger_kernel"] = importlib.util.find_spec("liger_kernel") is not None
    args = TRLConfig(output_dir="/tmp/trl-bench-rl", report_to="none", save_strategy="no", use_vllm=False,
                     disable_dropout=True, **kwargs)
    spans: list[tuple[float, float]] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            torch.cuda.synchronize()
            spans.append((self.t0, time.perf_counter()))

    mon = GpuMonitor()
    trainer = TRLTrainer(model=model, reward_funcs=even_token_reward, args=args, train_dataset=data,
                         processing_class=tok, callbacks=[StepTimer()])
    mon.start()
    trainer.train()
    mon.stop()
    steady = spans[1:]  # after the warm-up step, as tandem's
    out = _summary([{"wall": end - start} for start, end in steady], cfg)
    out["gpu"] = mon.summary(window=(steady[0][0], steady[-1][1]))  # the timed steps only
    out["liger"] = bool(kwargs.get("use_liger_kernel"))
    del trainer, model
    return out


def _summary(steps: list[dict], cfg: RLBenchConfig) -> dict:
    wall = statistics.median(s["wall"] for s in steps)
    tokens = cfg.num_prompts * cfg.num_generations * cfg.completion_len
    return {"step_s_median": wall, "step_s": [s["wall"] for s in steps],
            "completion_tokens_per_s": tokens / wall}


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

        return run_modes(cfg)
    names = [c for c in cfg.compare.split(",") if c]
    bad = [n for n in names if n not in ("trl", "trl-fast")]
    if bad:
        raise ValueError(f"--compare must name 'trl' and/or 'trl-fast', or be 'colocate,server'; got {bad}")
    if names and importlib.util.find_spec("trl") is None:
        raise ValueError("--compare trl needs TRL: pip install 'tandem[bench]' (or pip install trl)")
    if not torch.cuda.is_available():
        raise ValueError("bench rl times GPU training steps: it needs a CUDA GPU; on a CPU, "
                         "`tandem bench rl --compare colocate,server --device cpu` runs a small version")
    results = {}
    for name in [c for c in cfg.compare.split(",") if c] + ["tandem"]:
        if name not in ("trl", "trl-fast", "tandem"):
            raise ValueError(f"compare must name 'trl' and/or 'trl-fast', or be 'colocate,server'; got {name!r}")
        results[name] = run_tandem(cfg) if name == "tandem" else run_trl(cfg, fast=name == "trl-fast")
        gc.collect()
        torch.cuda.empty_cache()
    print(f"{'trainer':<9} {'s/step':>8} {'completion tok/s':>17} {'GPU util':>9}")
    for name, r in results.items():
        busy = r["gpu"].get("util_mean") if r["gpu"].get("available") else None
        busy_s = f"{busy:.0f}%" if busy is not None else "-"
        print(f"{name:<9} {r['step_s_median']:>8.2f} {r['completion_tokens_per_s']:>17,.0f} {busy_s:>9}")
    if "trl" in results:
        results["speedup_vs_trl"] = results["trl"]["step_s_median"] / results["tandem"]["step_s_median"]
        print(f"tandem step is {results['speedup_vs_trl']:.1f}x faster than TRL (use_vllm=False)")
    if "trl-fast" in results:
        results["speedup_vs_trl_fast"] = results["trl-fast"]["step_s_median"] / results["tandem"]["step_s_median"]
        print(f"tandem step is {results['speedup_vs_trl_fast']:.1f}x faster than TRL's fastest settings here "
              f"(no recompute, Liger {'on' if results['trl-fast']['liger'] else 'not installed'})")
    if "breakdown_s" in results.get("tandem", {}):
        print("tandem step breakdown (s): " + ", ".join(f"{k} {v:.2f}" for k, v in results["tandem"]["breakdown_s"].items()))
        t = results["tandem"]
        mem = t.get("train_memory", {})
        plan = f", plan {mem['memory/plan_train_gib']:.1f}" if "memory/plan_train_gib" in mem else ""
        mfu = (f"MFU {100 * t['train_mfu']:.1f}% (6 x params x tokens / {t['peak_flops'] / 1e12:.0f} "
               "TFLOP/s)" if t["train_mfu"] is not None else "MFU unknown (this GPU's peak is not known)")
        print(f"tandem train phase: {t['breakdown_s']['train']:.2f} s, {mfu}, recompute "
              f"{'on' if mem.get('memory/recompute') else 'off'}; peak {mem.get('memory/train_peak_gib', 0):.1f} GiB"
              f"{plan} (resident {mem.get('memory/train_resident_gib', 0):.1f})")
        from tandem.rl.memory_table import format_measured

        print("tandem memory per phase (GiB), the plan's steady state beside the timed steps' medians:")
        print(format_measured(mem))
        by_phase = {k: v for k, v in results["tandem"]["gpu_util_by_phase"].items() if v is not None}
        if by_phase:
            print("tandem GPU utilization by phase: " + ", ".join(f"{k} {v:.0f}%" for k, v in by_phase.items()))
    report = make_report("rl", asdict(cfg), results)
    finish(report, cfg.output, cfg.print_json)
    return report


_HELP = {
    "model": "architecture preset or HF model dir (its architecture; the weights stay random)",
    "num_prompts": "prompts per step", "num_generations": "completions per prompt",
    "prompt_len": "prompt tokens", "completion_len": "completion tokens (ignore_eos)",
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
                   help="--compare colocate,server only: cpu runs both modes on the CPU, small")
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
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    kw = {k: v for k, v in vars(args).items() if k in RLBenchConfig.__dataclass_fields__}
    sizes = CPU_SIZES if args.device == "cpu" else {}
    for name in CPU_SIZES:
        if kw.get(name) is None:
            kw[name] = sizes.get(name, getattr(RLBenchConfig, name))
    run(RLBenchConfig(**kw))
    return 0
