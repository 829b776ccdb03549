"""`tandem bench throughput`: offline generation tokens/s for tandem and, side by side, HF generate.

Both run in one process on the same weights, prompts and batch; HF goes first (tandem's KV cache
takes most of the free memory), then hands its weights to tandem in memory.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass, field

import torch

from tandem.bench.roofline import (
    H200_BF16_FLOPS,
    H200_HBM_BYTES_PER_S,
    ModelShape,
    ceiling_tokens_per_s,
)

WORKLOADS = {  # BENCHMARKS.md
    "gen-1.5b": dict(model="qwen2.5-1.5b", num_prompts=256, input_len=128, output_len=256),
    "gen-1.5b-long": dict(
        model="qwen2.5-1.5b", num_prompts=256, input_len=(100, 1024), output_len=(100, 1024)
    ),
    "gen-7b": dict(model="qwen2.5-7b", num_prompts=256, input_len=128, output_len=256),
}


@dataclass
class ThroughputConfig:
    model: str | None = "qwen2.5-1.5b"
    workload: str | None = None
    load_format: str = "dummy"
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
    tensor_parallel_size: int = 1
    profile: bool = False  # after the timed run, profile decode steps (torch.profiler)
    hbm_bytes_per_s: float = H200_HBM_BYTES_PER_S
    peak_flops: float = H200_BF16_FLOPS
    output: str | None = None
    progress: bool = True


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

    source = resolve_model(cfg.model, cfg.load_format)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype(cfg.dtype, source.hf_config, device)
    if source.path and cfg.load_format != "dummy":
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
    elapsed = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return _figures("hf", elapsed, prompts, useful, peak)


def run_tandem(
    model_or_name, prompts: list[list[int]], out_lens: list[int], cfg: ThroughputConfig
) -> tuple[dict, object]:
    from tandem import LLM, SamplingParams

    max_len = max(len(p) + o for p, o in zip(prompts, out_lens))
    kwargs = dict(
        dtype=cfg.dtype,
        max_model_len=max_len,
        max_num_seqs=cfg.max_num_seqs,
        seed=cfg.seed,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        enforce_eager=cfg.enforce_eager, async_scheduling=cfg.async_scheduling,
        gpu_memory_utilization=cfg.gpu_memory_utilization, tensor_parallel_size=cfg.tensor_parallel_size,
    )
    if isinstance(model_or_name, torch.nn.Module):
        llm = LLM(model_or_name, **kwargs)
    else:
        llm = LLM(model_or_name, load_format=cfg.load_format, **kwargs)
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
    elapsed = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(out_lens), "ignore_eos requests must produce exactly max_tokens"
    peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else None
    fig = _figures("tandem", elapsed, prompts, produced, peak)
    fig["step_stats"] = {k: {"steps": n, "seconds": sec, "ms_per_step": 1e3 * sec / max(1, n)}
                         for k, (n, sec) in eng.step_stats.items()}
    fig["prefix_cache_hit_tokens"] = eng.block_manager.num_prefix_hits - hits_before
    steps = sum(v["steps"] for v in fig["step_stats"].values())
    fig["host_waiting_on_device_s"] = eng.device_wait_s
    print("tandem steps: " + ", ".join(f"{k} {v['steps']} x {v['ms_per_step']:.2f} ms"
                                       for k, v in fig["step_stats"].items())
          + f"; the host waited on the device {1e3 * eng.device_wait_s / max(1, steps):.2f} ms/step"
          f" (near 0: the host is the bottleneck); prefix-cache hits {fig['prefix_cache_hit_tokens']} tokens")
    if cfg.profile:
        from tandem.bench.profile_step import profile_decode

        fig["profile"] = profile_decode(llm, num_steps=20, batch=min(len(prompts), cfg.max_num_seqs),
                                        prompt_len=max(map(len, prompts)))
    fig.update(
        kv_cache_blocks=eng.num_blocks,
        preemptions=eng.scheduler.num_preemptions,
        cudagraph_capture_s=eng.worker.cudagraph_capture_s,
        kernel_warmup_s=eng.worker.kernel_warmup_s,
        attention_backend=eng.worker.attention_backend,
    )
    return fig, llm


def _figures(name, elapsed, prompts, out_tokens, peak) -> dict:
    in_tokens = sum(map(len, prompts))
    return {
        "backend": name,
        "elapsed_s": elapsed,
        "requests_per_s": len(prompts) / elapsed,
        "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (in_tokens + out_tokens) / elapsed,
        "output_tokens": out_tokens,
        "input_tokens": in_tokens,
        "peak_memory_gb": peak / 1e9 if peak is not None else None,
    }


def run(cfg: ThroughputConfig) -> dict:
    from tandem.bench.report import finish, make_report

    if cfg.workload:
        if cfg.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {sorted(WORKLOADS)}, got {cfg.workload!r}")
        for k, v in WORKLOADS[cfg.workload].items():
            setattr(cfg, k, v)
    backends = [cfg.backend] + [b for b in cfg.compare if b != cfg.backend]
    for b in backends:
        if b not in ("tandem", "hf"):
            raise ValueError(f"backend/compare must be 'tandem' or 'hf', got {b!r}")
    results: dict = {}
    hf_model = None
    source = None
    if "hf" in backends:
        hf_model, source = _build_hf_model(cfg)
        vocab = hf_model.config.vocab_size
    else:
        from tandem.models.loader import resolve_model

        source = resolve_model(cfg.model, cfg.load_format)
        vocab = source.hf_config.vocab_size
    prompts, out_lens = make_prompts(cfg, vocab)
    gpu = None
    llm = None
    from tandem.bench.gpu_monitor import GpuMonitor

    if "hf" in backends:
        results["hf"] = run_hf(hf_model, prompts, out_lens, cfg)
    if "tandem" in backends:
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        with GpuMonitor() as mon:
            results["tandem"], llm = run_tandem(
                hf_model if hf_model is not None else cfg.model, prompts, out_lens, cfg
            )
        gpu = mon.summary()
    shape = ModelShape.from_hf_config(source.hf_config)
    ceiling = ceiling_tokens_per_s(
        shape,
        [len(p) for p in prompts],
        out_lens,
        cfg.max_num_seqs,
        cfg.hbm_bytes_per_s * cfg.tensor_parallel_size,  # TP=N: N GPUs' bandwidth and FLOPs
        cfg.peak_flops * cfg.tensor_parallel_size,
    )
    for r in results.values():
        r["roofline_tokens_per_s"] = ceiling
        r["roofline_fraction"] = r["output_tokens_per_s"] / ceiling
    if "hf" in results and "tandem" in results:
        results["speedup_vs_hf"] = (
            results["tandem"]["output_tokens_per_s"] / results["hf"]["output_tokens_per_s"]
        )
    report = make_report("throughput", asdict(cfg), results, gpu)
    _print_table(results)
    finish(report, cfg.output)
    if llm is not None and llm.tp_workers is not None:
        llm.tp_workers.shutdown()  # after the report: the figures stand whatever teardown does
    return report


def _print_table(results: dict) -> None:
    print(
        f"{'backend':<8} {'out tok/s':>11} {'total tok/s':>12} {'req/s':>8} {'peak GB':>8} {'roofline':>9}"
    )
    for name in ("hf", "tandem"):
        r = results.get(name)
        if r is None:
            continue
        peak = f"{r['peak_memory_gb']:.1f}" if r["peak_memory_gb"] is not None else "-"
        print(
            f"{name:<8} {r['output_tokens_per_s']:>11,.0f} {r['total_tokens_per_s']:>12,.0f} "
            f"{r['requests_per_s']:>8.2f} {peak:>8} {100 * r['roofline_fraction']:>8.1f}%"
        )
    if "speedup_vs_hf" in results:
        print(f"tandem / hf output tokens/s: {results['speedup_vs_hf']:.1f}x")


def _len_arg(s: str):
    if "-" in s or ":" in s:
        lo, hi = s.replace(":", "-").split("-")
        return (int(lo), int(hi))
    return int(s)


def add_parser(subparsers) -> None:
    d = ThroughputConfig()
    p = subparsers.add_parser("throughput", help="offline generation throughput (tandem and/or HF)")
    p.add_argument(
        "--model", default=d.model, help="architecture name (dummy weights) or local dir"
    )
    p.add_argument("--workload", default=None, choices=sorted(WORKLOADS))
    p.add_argument("--load-format", default=d.load_format)
    p.add_argument("--dtype", default=d.dtype)
    p.add_argument("--num-prompts", type=int, default=d.num_prompts)
    p.add_argument("--input-len", type=_len_arg, default=d.input_len, help="N or MIN-MAX (uniform)")
    p.add_argument(
        "--output-len", type=_len_arg, default=d.output_len, help="N or MIN-MAX (uniform)"
    )
    p.add_argument("--dataset", default=None, help="JSONL file of {'prompt': text}")
    p.add_argument("--backend", default=d.backend, choices=["tandem", "hf"])
    p.add_argument(
        "--compare", default="", help="comma list of peers to run in the same invocation: hf"
    )
    p.add_argument("--hf-batch-size", type=int, default=None)
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
                   help="launch each step before reading the previous one's tokens (default: on for CUDA)")
    p.add_argument("--tensor-parallel-size", type=int, default=d.tensor_parallel_size)
    p.add_argument("--profile", action="store_true", help="profile decode steps after the timed run")
    p.add_argument("--hbm-bytes-per-s", type=float, default=d.hbm_bytes_per_s)
    p.add_argument("--peak-flops", type=float, default=d.peak_flops)
    p.add_argument("--output", default=None, help="write the JSON report here")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    kw = {k: v for k, v in vars(args).items() if k in ThroughputConfig.__dataclass_fields__}
    kw["compare"] = [c for c in (args.compare or "").split(",") if c]
    run(ThroughputConfig(**kw))
    return 0
