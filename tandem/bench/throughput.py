"""`tandem bench throughput`: offline generation tokens/s for tandem and, side by side, HF generate.

Both run in one process on the same weights, prompts and batch; HF goes first (tandem's KV cache
takes most of the free memory), then hands its weights to tandem in memory. A model dir runs its
own weights; an architecture name (or --load-format dummy) random ones. With no workload given a
GPU runs gen-1.5b's shape, a CPU a small job on the embedded SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from tandem.bench.roofline import (
    ModelShape,
    ceiling_tokens_per_s,
    device_ceilings,
    prefill_floor_seconds,
)

WORKLOADS = {  # docs/benchmarks.md
    "gen-1.5b": dict(model="qwen2.5-1.5b", num_prompts=256, input_len=128, output_len=256),
    "gen-1.5b-long": dict(
        model="qwen2.5-1.5b", num_prompts=256, input_len=(100, 1024), output_len=(100, 1024)
    ),
    "gen-7b": dict(model="qwen2.5-7b", num_prompts=256, input_len=128, output_len=256),
}


# the workload when none is named: gen-1.5b's shape on a GPU, a minute's work on a CPU
GPU_DEFAULTS = dict(model="qwen2.5-1.5b", num_prompts=256, input_len=128, output_len=256)
CPU_DEFAULTS = dict(model=None, num_prompts=8, input_len=32, output_len=32)


@dataclass
class ThroughputConfig:
    model: str | None = "qwen2.5-1.5b"  # None: the embedded SmolLM2-135M-Instruct
    workload: str | None = None
    load_format: str = "auto"  # auto: a dir's weights; an architecture name gets random ones
    dtype: str = "auto"
    num_prompts: int = 256
    input_len: int | tuple[int, int] = 128
    output_len: int | tuple[int, int] = 256
    dataset: str | None = None  # JSONL with "prompt" (text) per line
    backend: str = "tandem"
    compare: list[str] = field(default_factory=list)
    hf_batch_size: int | None = None  # default: all prompts in one batch
    temperature: float = 1.0
    seed: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    async_scheduling: bool | None = None  # None: the engine's default (on for CUDA)
    num_scheduler_steps: int | None = None  # None: the engine's default (EngineConfig)
    tensor_parallel_size: int = 1
    decode_gemm: str = "auto"  # EngineConfig.decode_gemm
    # EngineConfig.host_only: no forward or sampling, a fixed token a row: the engine's host work
    # a token, its ceiling whatever the model (no roofline: the device does not work)
    host_only: bool = False
    # vLLM's `bench throughput --async-engine`: through AsyncLLM, the engine in a process of its own
    # as `tandem serve` runs it, each request streaming deltas (`throughput_async.py`)
    async_engine: bool = False
    stream_interval: int = 1  # EngineConfig.stream_interval (with async_engine)
    tokenizer: str | None = None  # EngineConfig.tokenizer: text for random weights (async_engine)
    profile: bool = False  # after the timed run, profile decode steps and prompt steps (torch.profiler)
    hbm_bytes_per_s: float | None = None  # None: the device's, where known (roofline.py)
    peak_flops: float | None = None
    output: str | None = None
    print_json: bool = False
    progress: bool = True


def _load_format(cfg: ThroughputConfig) -> str:
    """An architecture name has no weights on disk: random ones, as vLLM's --load-format dummy."""
    from tandem.models.presets import preset_config

    if cfg.load_format == "auto" and isinstance(cfg.model, str) and not os.path.exists(cfg.model) \
            and preset_config(cfg.model) is not None:
        return "dummy"
    return cfg.load_format


def _lengths(spec, n: int, rng: random.Random) -> list[int]:
    if isinstance(spec, (tuple, list)):
        return [rng.randint(spec[0], spec[1]) for _ in range(n)]
    return [int(spec)] * n


def make_prompts(
    cfg: ThroughputConfig, vocab_size: int, tokenizer=None
) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(cfg.seed)
    out_lens = _lengths(cfg.output_len, cfg.num_prompts, rng)
    if cfg.dataset:
        if tokenizer is None:
            raise ValueError("dataset: text prompts need a model with a tokenizer")
        with open(cfg.dataset) as f:
            texts = [json.loads(line)["prompt"] for line in f if line.strip()][: cfg.num_prompts]
        return [tokenizer.encode(t) for t in texts], out_lens[: len(texts)]
    in_lens = _lengths(cfg.input_len, cfg.num_prompts, rng)
    # random ids away from special tokens, as vLLM's random dataset does
    hi = min(vocab_size, 32000) - 1
    return [[rng.randint(100, hi) for _ in range(n)] for n in in_lens], out_lens


def _build_hf_model(cfg: ThroughputConfig):
    from transformers import AutoModelForCausalLM

    from tandem.engine.memory import resolve_dtype
    from tandem.models.loader import resolve_model

    load_format = _load_format(cfg)
    source = resolve_model(cfg.model, load_format)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype(cfg.dtype, source.hf_config, device)
    if source.path and load_format != "dummy":
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype)
    else:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(source.hf_config, dtype=dtype)
        from tandem.models.loader import init_dummy_weights

        init_dummy_weights(model, cfg.seed)
    return model.to(device).eval(), source


@torch.inference_mode()
def run_hf(model, prompts: list[list[int]], out_lens: list[int], cfg: ThroughputConfig) -> dict:
    """HF `generate`, static batches, left padding; every sample runs to its batch's longest output."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    bs = cfg.hf_batch_size or len(prompts)
    pad = 0
    useful = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for s in tqdm(range(0, len(prompts), bs), desc="hf generate", disable=not cfg.progress):
        batch, lens = prompts[s : s + bs], out_lens[s : s + bs]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        n = max(lens)
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=cfg.temperature > 0,
            temperature=cfg.temperature or None,
            top_p=None,
            top_k=None,
            pad_token_id=pad,
        )
        useful += sum(lens)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return _figures("hf", (t0, t1), prompts, useful, peak)


def engine_kwargs(cfg: ThroughputConfig, prompts: list[list[int]], out_lens: list[int]) -> dict:
    """The engine's settings for the timed run, offline or through AsyncLLM."""
    return dict(
        dtype=cfg.dtype,
        max_model_len=max(len(p) + o for p, o in zip(prompts, out_lens)),
        max_num_seqs=cfg.max_num_seqs,
        seed=cfg.seed,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        enforce_eager=cfg.enforce_eager, async_scheduling=cfg.async_scheduling,
        **({} if cfg.num_scheduler_steps is None else {"num_scheduler_steps": cfg.num_scheduler_steps}),
        gpu_memory_utilization=cfg.gpu_memory_utilization, tensor_parallel_size=cfg.tensor_parallel_size,
        decode_gemm=cfg.decode_gemm, host_only=cfg.host_only,
    )


def run_tandem(
    model_or_name, prompts: list[list[int]], out_lens: list[int], cfg: ThroughputConfig
) -> tuple[dict, object]:
    from tandem import LLM, SamplingParams

    kwargs = engine_kwargs(cfg, prompts, out_lens)
    if isinstance(model_or_name, torch.nn.Module):
        llm = LLM(model_or_name, **kwargs)
    else:
        llm = LLM(model_or_name, load_format=_load_format(cfg), **kwargs)
    params = [
        SamplingParams(temperature=cfg.temperature, max_tokens=o, ignore_eos=True) for o in out_lens
    ]
    # a full first wave at 2 tokens: JIT-compiles every kernel variant the timed run's prefill
    # chunks and full-batch decode will launch, outside the timed region
    warm = [SamplingParams(temperature=cfg.temperature, max_tokens=2, ignore_eos=True)] * min(
        cfg.max_num_seqs, len(prompts)
    )
    llm.generate(prompts[: len(warm)], warm, use_tqdm=False)
    # The warm-up ran these very prompts: forget their cached prefixes, or the timed run would skip
    # most of its prefill (HF's generate, beside it, computes every prompt token)
    llm.reset_prefix_cache()  # the LLM's: under tensor parallel every rank must forget alike
    dev = llm.llm_engine.device
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    eng = llm.llm_engine
    eng.step_stats = {k: [0, 0.0] for k in eng.step_stats}
    eng.device_wait_s = 0.0
    hits_before = eng.block_manager.num_prefix_hits
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=cfg.progress)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(out_lens), "ignore_eos requests must produce exactly max_tokens"
    peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else None
    fig = _figures("tandem", (t0, t1), prompts, produced, peak)
    add_step_figures(fig, eng.step_stats, eng.device_wait_s,
                     eng.block_manager.num_prefix_hits - hits_before, eng.config.num_scheduler_steps)
    if cfg.profile:
        from tandem.bench.profile_step import profile_decode, profile_prefill

        prompt_len = max(map(len, prompts))
        fig["profile"] = profile_decode(llm, num_steps=20, batch=min(len(prompts), cfg.max_num_seqs),
                                        prompt_len=prompt_len)
        if getattr(llm, "tp_workers", None) is None:  # (it drives the engine step by step)
            fig["profile_prefill"] = profile_prefill(llm, prompt_len=prompt_len)
    fig.update(
        kv_cache_blocks=eng.num_blocks,
        preemptions=eng.scheduler.num_preemptions,
        cudagraph_capture_s=eng.worker.cudagraph_capture_s,
        kernel_warmup_s=eng.worker.kernel_warmup_s,
        attention_backend=eng.worker.attention_backend,
        num_scheduler_steps=eng.config.num_scheduler_steps,
    )
    return fig, llm


def add_step_figures(fig: dict, step_stats: dict, device_wait_s: float, prefix_hits: int,
                     num_scheduler_steps: int) -> None:
    """The timed run's engine steps by kind, the host's wait on the device, prefix-cache hits:
    into `fig`, and one printed line."""
    fig["step_stats"] = {k: {"steps": n, "seconds": sec, "ms_per_step": 1e3 * sec / max(1, n)}
                         for k, (n, sec) in step_stats.items()}
    fig["prefix_cache_hit_tokens"] = prefix_hits
    fig["host_waiting_on_device_s"] = device_wait_s
    steps = sum(v["steps"] for v in fig["step_stats"].values())
    print("tandem steps: " + ", ".join(f"{k} {v['steps']} x {v['ms_per_step']:.2f} ms"
                                       for k, v in fig["step_stats"].items())
          + f" (decode windows of {num_scheduler_steps})"
          + f"; the host waited on the device {1e3 * device_wait_s / max(1, steps):.2f} ms/step"
          f" (near 0: the host is the bottleneck); prefix-cache hits {prefix_hits} tokens")


def phases(fig: dict, prefill_floor_s: float | None) -> dict:
    """Where the timed run went: steps that carry prompt tokens (prefill chunks, with any decode
    rows mixed in) against decode-only steps, each as seconds and share of the run; the prefill
    steps also against their GEMMs' compute floor (`prefill_floor_seconds`), which the decode
    roofline leaves out. Seconds are the engine loop's per step (scheduling to booking)."""
    out = {}
    for name, st in fig["step_stats"].items():
        out[name] = {"steps": st["steps"], "seconds": st["seconds"],
                     "share_of_run": st["seconds"] / fig["elapsed_s"]}
    prefill = out.get("prefill_or_mixed")
    if prefill is not None and prefill_floor_s is not None:
        prefill["compute_floor_s"] = prefill_floor_s
        prefill["floor_fraction"] = prefill_floor_s / prefill["seconds"] if prefill["seconds"] else None
    return out


def _figures(name, span, prompts, out_tokens, peak) -> dict:
    in_tokens = sum(map(len, prompts))
    elapsed = span[1] - span[0]
    return {
        "backend": name,
        "timed_span": span,  # perf_counter (start, end) of the timed part
        "elapsed_s": elapsed,
        "requests_per_s": len(prompts) / elapsed,
        "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (in_tokens + out_tokens) / elapsed,
        "output_tokens": out_tokens,
        "input_tokens": in_tokens,
        "peak_memory_gb": peak / 1e9 if peak is not None else None,
    }


def apply_defaults(cfg: ThroughputConfig, explicit: set[str], cuda: bool) -> None:
    """A named workload's settings, or the device's default workload for what was not given."""
    if cfg.workload:
        if cfg.workload not in WORKLOADS:
            raise ValueError(f"--workload must be one of {sorted(WORKLOADS)}, got {cfg.workload!r}")
        for k, v in WORKLOADS[cfg.workload].items():
            setattr(cfg, k, v)
        if not cuda:
            print(f"warning: {cfg.workload} is a GPU workload; on this CPU it takes hours "
                  "(without --workload a CPU gets a small one)", file=sys.stderr)
        return
    defaults = GPU_DEFAULTS if cuda else CPU_DEFAULTS
    missing = {k: v for k, v in defaults.items() if k not in explicit}
    for k, v in missing.items():
        setattr(cfg, k, v)
    if not cuda and missing:
        print(f"no GPU: a small CPU workload ({cfg.num_prompts} prompts, {cfg.input_len} -> "
              f"{cfg.output_len} tokens, {cfg.model or 'the embedded SmolLM2-135M-Instruct'}); "
              "--model, --num-prompts, --input-len, --output-len or --workload change it")


def run(cfg: ThroughputConfig) -> dict:
    from tandem.bench.gpu_monitor import GpuMonitor
    from tandem.bench.report import finish, make_report

    if cfg.workload:
        apply_defaults(cfg, set(), torch.cuda.is_available())
    check_async_engine(cfg)
    backends = [cfg.backend] + [b for b in cfg.compare if b != cfg.backend]
    if cfg.host_only and (backends != ["tandem"] or cfg.profile):
        raise ValueError("--host-only times tandem's host work alone: drop --compare/--backend hf "
                         "and --profile (there is no device work to compare or profile)")
    for b in backends:
        if b not in ("tandem", "hf"):
            raise ValueError(f"--backend/--compare must be 'tandem' or 'hf', got {b!r}")
    results: dict = {}
    hf_model = None
    source = None
    with GpuMonitor() as mon:  # the whole run; each backend's figures come from its timed span
        if "hf" in backends:
            hf_model, source = _build_hf_model(cfg)
            vocab = hf_model.config.vocab_size
        else:
            from tandem.models.loader import resolve_model

            source = resolve_model(cfg.model, _load_format(cfg))
            vocab = source.hf_config.vocab_size
        prompts, out_lens = make_prompts(cfg, vocab)
        llm = None
        if "hf" in backends:
            results["hf"] = run_hf(hf_model, prompts, out_lens, cfg)
        if "tandem" in backends and cfg.async_engine:
            from tandem.bench.throughput_async import run_tandem_async

            hf_model = None  # the engine process loads its own weights: HF's go first
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
            results["tandem"] = run_tandem_async(prompts, out_lens, cfg)
        elif "tandem" in backends:
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
            results["tandem"], llm = run_tandem(
                hf_model if hf_model is not None else cfg.model, prompts, out_lens, cfg
            )
    gpu = mon.summary()
    for r in results.values():  # the GPU over each backend's timed window, not model builds
        r["gpu"] = mon.summary(window=tuple(r["timed_span"])) if mon.available else None
    hbm, flops, device_name = device_ceilings(cfg.hbm_bytes_per_s, cfg.peak_flops)
    ceiling = None
    shape = ModelShape.from_hf_config(source.hf_config)
    if hbm is not None and flops is not None and not cfg.host_only:
        ceiling = ceiling_tokens_per_s(
            shape,
            [len(p) for p in prompts],
            out_lens,
            cfg.max_num_seqs,
            hbm * cfg.tensor_parallel_size,  # TP=N: N GPUs' bandwidth and FLOPs
            flops * cfg.tensor_parallel_size,
        )
    for r in results.values():
        r["roofline_tokens_per_s"] = ceiling
        r["roofline_fraction"] = r["output_tokens_per_s"] / ceiling if ceiling else None
    if "tandem" in results:
        prefill_floor = None
        if flops is not None and not cfg.host_only:
            prefill_floor = prefill_floor_seconds(shape, sum(map(len, prompts)),
                                                  flops * cfg.tensor_parallel_size)
        results["tandem"]["phases"] = phases(results["tandem"], prefill_floor)
    if "hf" in results and "tandem" in results:
        results["speedup_vs_hf"] = (
            results["tandem"]["output_tokens_per_s"] / results["hf"]["output_tokens_per_s"]
        )
    config = asdict(cfg) | {"load_format": _load_format(cfg), "roofline_device": device_name}
    report = make_report("throughput", config, results, gpu)
    _print_table(results, device_name, cfg.host_only)
    finish(report, cfg.output, cfg.print_json)
    if llm is not None and llm.tp_workers is not None:
        llm.tp_workers.shutdown()  # after the report: the figures stand whatever teardown does
    return report


def check_async_engine(cfg: ThroughputConfig) -> None:
    """Settings that only the AsyncLLM run reads, or that it cannot take: refused before any work."""
    if cfg.async_engine:
        if cfg.profile:
            raise ValueError("--profile profiles the offline engine in this process; drop --async-engine "
                             "or --profile")
        if cfg.tensor_parallel_size != 1:
            raise ValueError("--async-engine runs the engine as `tandem serve` does, on one GPU: "
                             f"--tensor-parallel-size must be 1, got {cfg.tensor_parallel_size}")
        return
    if cfg.stream_interval != 1 or cfg.tokenizer is not None:
        raise ValueError("--stream-interval and --tokenizer apply to --async-engine only (the offline "
                         "run returns token ids): add --async-engine or drop them")


def _print_table(results: dict, roofline_device: str | None = None, host_only: bool = False) -> None:
    roof = any(r.get("roofline_fraction") is not None for r in results.values() if isinstance(r, dict))
    gpu = any(r.get("gpu") for r in results.values() if isinstance(r, dict))
    print(f"{'backend':<8} {'out tok/s':>11} {'total tok/s':>12} {'req/s':>8} {'peak GB':>8}"
          + (f" {'roofline':>9}" if roof else "") + (f" {'GPU util':>9}" if gpu else ""))
    for name in ("hf", "tandem"):
        r = results.get(name)
        if r is None:
            continue
        peak = f"{r['peak_memory_gb']:.1f}" if r["peak_memory_gb"] is not None else "-"
        line = (f"{name:<8} {r['output_tokens_per_s']:>11,.0f} {r['total_tokens_per_s']:>12,.0f} "
                f"{r['requests_per_s']:>8.2f} {peak:>8}")
        if roof:
            line += f" {100 * r['roofline_fraction']:>8.1f}%"
        if gpu:
            util = (r.get("gpu") or {}).get("util_mean")
            line += f" {util:>8.0f}%" if util is not None else f" {'-':>9}"
        print(line)
    if "speedup_vs_hf" in results:
        print(f"tandem / hf output tokens/s: {results['speedup_vs_hf']:.1f}x")
    ph = (results.get("tandem") or {}).get("phases")
    if ph:
        parts = []
        for name, label in (("prefill_or_mixed", "steps with prompt tokens"), ("decode", "decode-only steps")):
            p = ph.get(name)
            if p is None:
                continue
            part = f"{label} {p['steps']} x, {p['seconds']:.3f} s ({100 * p['share_of_run']:.0f}% of the run"
            if p.get("floor_fraction") is not None:
                part += (f"; their GEMMs' compute floor {p['compute_floor_s']:.3f} s, "
                         f"{100 * p['floor_fraction']:.0f}% of their time")
            parts.append(part + ")")
        print("tandem phases: " + "; ".join(parts))
    if host_only:
        print("host only: no forward and no sampling on the device (a fixed token a row); these "
              "figures are the engine's host work, the most it could give whatever the model")
    elif roof:
        print(f"roofline: the decode ceiling of {roofline_device} (docs/benchmarks.md)")
    else:
        print("no roofline: this device's bandwidth and FLOP/s are not known here; "
              "--hbm-bytes-per-s and --peak-flops give them")


def _len_arg(s: str):
    if "-" in s or ":" in s:
        lo, hi = s.replace(":", "-").split("-")
        return (int(lo), int(hi))
    return int(s)


def add_parser(subparsers) -> None:
    from tandem.bench.report import add_output_args

    d = ThroughputConfig()
    p = subparsers.add_parser("throughput", help="offline generation throughput (tandem and/or HF)",
                              description=__doc__)
    p.add_argument("--model", default=None,
                   help="local model dir (its weights), .gguf, or architecture name (random weights) "
                   "(default: qwen2.5-1.5b on a GPU, the embedded SmolLM2-135M-Instruct on a CPU)")
    p.add_argument("--workload", default=None, choices=sorted(WORKLOADS),
                   help="a named workload of docs/benchmarks.md (sets model, prompts and lengths)")
    p.add_argument("--load-format", default=d.load_format,
                   help="auto: a dir's own weights, random ones for an architecture name | dummy | "
                   "safetensors | pt | gguf")
    p.add_argument("--dtype", default=d.dtype, help="auto | float32 | float16 | bfloat16")
    p.add_argument("--num-prompts", type=int, default=None,
                   help=f"prompts (default: {GPU_DEFAULTS['num_prompts']} on a GPU, "
                   f"{CPU_DEFAULTS['num_prompts']} on a CPU)")
    p.add_argument("--input-len", type=_len_arg, default=None,
                   help=f"prompt tokens, N or MIN-MAX (uniform) (default: {GPU_DEFAULTS['input_len']} on "
                   f"a GPU, {CPU_DEFAULTS['input_len']} on a CPU)")
    p.add_argument("--output-len", type=_len_arg, default=None,
                   help=f"output tokens, N or MIN-MAX (uniform) (default: {GPU_DEFAULTS['output_len']} "
                   f"on a GPU, {CPU_DEFAULTS['output_len']} on a CPU)")
    p.add_argument("--dataset", default=None, help="JSONL file of {'prompt': text}")
    p.add_argument("--backend", default=d.backend, choices=["tandem", "hf"], help="what to time")
    p.add_argument(
        "--compare", default="", help="comma list of peers to run in the same invocation: hf"
    )
    p.add_argument("--hf-batch-size", type=int, default=None,
                   help="HF generate's static batch (default: all prompts at once)")
    p.add_argument("--temperature", type=float, default=d.temperature, help="sampling temperature")
    p.add_argument("--seed", type=int, default=d.seed, help="prompts' and sampling's seed")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="tandem's batch bound")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="tandem's tokens per step")
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="tandem's share of GPU memory")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
                   help="launch each step before reading the previous one's tokens (default: on for CUDA)")
    p.add_argument("--num-scheduler-steps", type=int, default=d.num_scheduler_steps,
                   help="decode steps per scheduling round (default: the engine's)")
    p.add_argument("--tensor-parallel-size", type=int, default=d.tensor_parallel_size,
                   help="GPUs to shard tandem's model over")
    p.add_argument("--decode-gemm", default=d.decode_gemm,
                   help="auto | cublas | triton | a table .json (python -m tandem.bench.gemm "
                   "--table-out): EngineConfig.decode_gemm")
    p.add_argument("--host-only", action="store_true",
                   help="no forward or sampling, a fixed token a row: the engine's host work a token "
                   "(the ceiling the host sets, whatever the model)")
    p.add_argument("--profile", action="store_true", help="profile decode steps and prompt-only steps after the timed run")
    p.add_argument("--async-engine", action="store_true",
                   help="run tandem through AsyncLLM, the engine in a process of its own as `tandem "
                   "serve` runs it, each request streaming its outputs, without HTTP (vLLM's flag)")
    p.add_argument("--stream-interval", type=int, default=d.stream_interval,
                   help="with --async-engine: a request's output every N tokens, as `tandem serve "
                   "--stream-interval`")
    p.add_argument("--tokenizer", default=d.tokenizer,
                   help="with --async-engine: a tokenizer dir for the streamed text (random weights "
                   "have none: without one the outputs carry token ids only)")
    p.add_argument("--hbm-bytes-per-s", type=float, default=None,
                   help="memory bandwidth for the roofline (default: the device's where known: H200)")
    p.add_argument("--peak-flops", type=float, default=None,
                   help="peak FLOP/s for the roofline (default: the device's where known: H200)")
    add_output_args(p)
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    kw = {k: v for k, v in vars(args).items() if k in ThroughputConfig.__dataclass_fields__}
    kw["compare"] = [c for c in (args.compare or "").split(",") if c]
    explicit = {k for k in GPU_DEFAULTS if kw.get(k) is not None}
    kw = {k: v for k, v in kw.items() if k not in GPU_DEFAULTS or v is not None}
    cfg = ThroughputConfig(**kw)
    if not cfg.workload:  # run() applies a named workload
        apply_defaults(cfg, explicit, torch.cuda.is_available())
    if cfg.model is not None:
        from tandem.engine.arg_utils import check_model_arg

        check_model_arg(cfg.model, _load_format(cfg))
    run(cfg)
    return 0
