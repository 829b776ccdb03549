"""Where a decode step's time goes: wall time, GPU kernel time, top kernels, host-side time.

    from tandem.bench.profile_step import profile_decode, profile_prefill
    profile_decode(llm, num_steps=20, trace_path="decode.json")
    profile_prefill(llm)  # prompt-only steps of a full token budget, the same breakdown

Fills the engine with a decode-heavy batch of its own, runs the prefills, times `num_steps`
decode steps without the profiler (wall ms per step), then `num_steps` more under torch.profiler
(kernel times, and the host time `LLMEngine.step` spends outside GPU waits). The requests are
aborted afterwards, so the engine is left as it was found. On a CPU only host op times exist.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import re
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile, record_function

STEP = "LLMEngine.step"
# Host calls that block until the GPU catches up (`.tolist()` of device tensors ends in one).
_WAIT = re.compile(r"^cuda(Stream|Device|Event)Synchronize$|^cudaMemcpy$")
# Kernel families by name, for a coarse breakdown (first match wins).
CATEGORIES = [
    ("all-reduce", r"nccl|all_?reduce"),
    ("attention", r"decode|prefill_attention|_attn|flash|fmha|merge_kernel"),
    ("sampling", r"sample|rank_kernel|argmax|softmax|logsumexp|exponential|topk|sort|philox"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|cublas|matmul|sm\d+_"),
    ("norm/act/rope", r"rms_norm|silu|rotary"),
    ("kv-cache write", r"store_kvcache|kv_cache"),
    ("copy/fill", r"^Memcpy|^Memset|copy|fill"),
]


@dataclass
class Event:
    """One profiler record: `kind` is 'kernel' (device time) or 'cpu' (host op or runtime call)."""

    name: str
    kind: str
    start_us: float
    dur_us: float


def category(kernel_name: str) -> str:
    for name, pattern in CATEGORIES:
        if re.search(pattern, kernel_name, re.IGNORECASE):
            return name
    return "other"


def summarize(events: list[Event], num_steps: int, top: int = 15) -> dict:
    """Per-step figures from the events of `num_steps` profiled steps."""
    kernels = [e for e in events if e.kind == "kernel"]
    cpu = [e for e in events if e.kind == "cpu"]
    steps = [e for e in cpu if e.name == STEP]
    step_us = sum(e.dur_us for e in steps)
    wait_us = sum(e.dur_us for e in cpu if _WAIT.match(e.name))
    out: dict = {
        "num_steps": num_steps,
        "step_ms": step_us / 1e3 / num_steps,
        "host_wait_ms": wait_us / 1e3 / num_steps,
        "host_busy_ms": (step_us - wait_us) / 1e3 / num_steps,
    }
    if kernels:
        busy = sum(e.dur_us for e in kernels)
        by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        by_cat: dict[str, float] = defaultdict(float)
        for e in kernels:
            by_name[e.name][0] += e.dur_us
            by_name[e.name][1] += 1
            by_cat[category(e.name)] += e.dur_us
        ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
        out["gpu_busy_ms"] = busy / 1e3 / num_steps
        out["kernels_per_step"] = len(kernels) / num_steps
        out["top_kernels"] = [
            {"name": n, "ms_per_step": t / 1e3 / num_steps, "calls_per_step": c / num_steps,
             "share": t / busy}
            for n, (t, c) in ranked
        ]
        out["categories"] = {
            k: {"ms_per_step": v / 1e3 / num_steps, "share": v / busy}
            for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])
        }
    else:  # no device activity recorded: report host ops by self time
        by_op: dict[str, float] = defaultdict(float)
        for e in cpu:
            if e.name != STEP:
                by_op[e.name] += e.dur_us
        ranked = sorted(by_op.items(), key=lambda kv: -kv[1])[:top]
        out["top_cpu_ops"] = [{"name": n, "ms_per_step": t / 1e3 / num_steps} for n, t in ranked]
    return out


def _events(prof) -> list[Event]:
    out = []
    for e in prof.events():
        kind = "kernel" if e.device_type == torch.autograd.DeviceType.CUDA else "cpu"
        if kind == "kernel" and e.name == STEP:
            continue  # the step's own range, mirrored on the device timeline: not a kernel
        dur = e.time_range.end - e.time_range.start
        # host ops: self time, so nested ops are not counted twice in the CPU-only table
        if kind == "cpu" and e.name != STEP and not _WAIT.match(e.name):
            dur = e.self_cpu_time_total
        out.append(Event(e.name, kind, e.time_range.start, dur))
    return out


def _add_batch(engine, batch: int, prompt_len: int, max_tokens: int, seed: int | str) -> list[str]:
    from tandem.sampling_params import SamplingParams

    rng = random.Random(seed)
    hi = min(engine.hf_config.vocab_size, 32000) - 1
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    return [
        engine.add_request(None, [rng.randint(100, hi) for _ in range(prompt_len)], params)
        for _ in range(batch)
    ]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _roofline_inputs(engine):
    """(model shape, HBM bytes/s, FLOP/s) where the device's ceilings are known, else None (a CPU,
    or a GPU measured nowhere here: no roofline rather than a wrong one)."""
    from tandem.bench.roofline import ModelShape, device_ceilings

    if engine.device.type != "cuda":
        return None
    hbm, flops, _ = device_ceilings()
    if hbm is None or flops is None:
        return None
    try:
        dtype_bytes = torch.empty((), dtype=engine.worker.dtype).element_size()
        return ModelShape.from_hf_config(engine.hf_config, dtype_bytes), hbm, flops
    except (AttributeError, TypeError):
        return None


def _ceiling_ms(engine, batch: int, context_per_seq: float) -> float | None:
    from tandem.bench.roofline import decode_step_seconds

    known = _roofline_inputs(engine)
    if known is None:
        return None
    shape, hbm, flops = known
    return 1e3 * decode_step_seconds(shape, batch, int(batch * context_per_seq), hbm, flops)


def _prefill_floor_ms(engine, tokens: int) -> float | None:
    from tandem.bench.roofline import prefill_floor_seconds

    known = _roofline_inputs(engine)
    return None if known is None else 1e3 * prefill_floor_seconds(known[0], tokens, known[2])


def profile_decode(
    llm,
    num_steps: int = 20,
    trace_path: str | None = None,
    batch: int | None = None,
    prompt_len: int = 128,
    seed: int = 0,
    verbose: bool = True,
) -> dict:
    """Profile decode steps of `llm` (a `tandem.LLM`) on a batch of random prompts.

    `batch` defaults to the engine's max_num_seqs, lowered to what the KV cache and
    max_model_len allow. Returns the figures as a dict and (with `verbose`) prints a table.
    """
    engine = llm.llm_engine
    if engine.has_unfinished_requests():
        raise RuntimeError("profile_decode needs an idle engine; it has unfinished requests")
    device = engine.device
    warmup = 3
    window = engine.config.num_scheduler_steps  # each phase may run up to a window past its count
    max_tokens = warmup + 2 * num_steps + 2 + 3 * window
    if engine.max_model_len < max_tokens + 2:
        raise ValueError(f"profile_decode runs {max_tokens} decode tokens a sequence: max_model_len "
                         f"{engine.max_model_len} leaves no room for them (needs >= {max_tokens + 2})")
    prompt_len = max(1, min(prompt_len, engine.max_model_len - max_tokens - 1))
    bs = engine.config.block_size
    blocks_per_seq = -(-(prompt_len + max_tokens) // bs)
    batch = min(batch or engine.config.max_num_seqs, max(1, engine.num_blocks // blocks_per_seq))
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    if getattr(llm, "tp_workers", None) is not None:
        wall_ms, prof = _profile_mirrored(llm, batch, prompt_len, max_tokens, num_steps, warmup, seed,
                                          activities)
        profiled = num_steps
    else:
        wall_ms, prof, profiled = _profile_steps(engine, batch, prompt_len, max_tokens, num_steps, warmup,
                                                 seed, activities)
    context = prompt_len + 1 + warmup + num_steps / 2  # mean tokens per sequence, timed
    if trace_path:
        prof.export_chrome_trace(trace_path)
    result = {"batch": batch, "prompt_len": prompt_len, "wall_ms": wall_ms,
              **summarize(_events(prof), profiled)}
    ceiling = _ceiling_ms(engine, batch, context)
    if ceiling is not None:
        result["ceiling_ms"] = ceiling
        result["roofline_fraction"] = ceiling / wall_ms
    if trace_path:
        result["trace"] = trace_path
    if verbose:
        print_profile(result)
    return result


def profile_prefill(
    llm,
    num_steps: int = 3,
    prompt_len: int = 128,
    seed: int = 0,
    verbose: bool = True,
) -> dict:
    """Profile prompt-only steps of `llm` (a `tandem.LLM`): each step a fresh batch of random
    prompts that fills the step's token budget (`max_num_batched_tokens`), computed in one engine
    step and aborted after it. Reports the wall time a step (device synchronised), the kernels by
    category, and the fraction of the prompt floor (the step's GEMM FLOPs at peak,
    `tandem.bench.roofline.prefill_floor_seconds`) where the device's ceilings are known."""
    engine = llm.llm_engine
    if engine.has_unfinished_requests():
        raise RuntimeError("profile_prefill needs an idle engine; it has unfinished requests")
    if getattr(llm, "tp_workers", None) is not None:
        raise ValueError("profile_prefill drives the engine step by step: not with spawned "
                         "tensor-parallel ranks")
    device = engine.device
    budget = engine.config.max_num_batched_tokens
    prompt_len = max(1, min(prompt_len, budget, engine.max_model_len - 2))
    blocks_per_seq = -(-(prompt_len + 2) // engine.config.block_size)
    batch = max(1, min(engine.config.max_num_seqs, budget // prompt_len,
                       engine.num_blocks // blocks_per_seq))
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)

    # Seeds of their own (strings: the decode profile's and every other caller's are ints), so no
    # prompt here repeats one an earlier run left in the prefix cache.
    seeds = (f"profile_prefill:{seed}:{i}" for i in itertools.count())
    hits_before = engine.block_manager.num_prefix_hits

    def one_step(label: bool) -> float:
        """Seconds of the prompt step alone (adding the requests and aborting them not counted)."""
        # prompts of their own each step: the same prompts again would be prefix-cache hits
        ids = _add_batch(engine, batch, prompt_len, 2, next(seeds))
        try:
            _sync(device)
            t0 = time.perf_counter()
            with record_function(STEP) if label else contextlib.nullcontext():
                engine.step()
            _sync(device)
            return time.perf_counter() - t0
        finally:
            engine.abort_request(ids)
            while engine.has_unfinished_requests():  # an in-flight step's read-back, if any
                engine.step()

    one_step(False)  # warm-up: this shape's kernels and allocations
    times = [one_step(False) for _ in range(num_steps)]
    with profile(activities=activities) as prof:
        for _ in range(num_steps):
            one_step(True)
    if engine.block_manager.num_prefix_hits != hits_before:
        raise RuntimeError("profile_prefill's prompts hit the prefix cache: the steps did not compute "
                           "every prompt token")
    events = _events(prof)
    result = {"kind": "prefill", "batch": batch, "prompt_len": prompt_len,
              "tokens_per_step": batch * prompt_len, "wall_ms": 1e3 * sorted(times)[len(times) // 2],
              **summarize(events, num_steps)}
    floor = _prefill_floor_ms(engine, batch * prompt_len)
    if floor is not None:
        result["floor_ms"] = floor
        result["floor_fraction"] = floor / result["wall_ms"]
    if verbose:
        print_profile(result)
    return result


def _profile_steps(engine, batch, prompt_len, max_tokens, num_steps, warmup, seed, activities):
    """Drive the engine step by step: time `num_steps` decode steps, then profile as many (at
    least: a decode window runs several per engine step). Returns the ms per decode step, the
    profile and the decode steps it holds."""
    device = engine.device
    ids = _add_batch(engine, batch, prompt_len, max_tokens, seed)

    def decode_steps():
        return engine.step_stats["decode"][0]

    def run(n, each=lambda: engine.step()):
        start = decode_steps()
        while decode_steps() - start < n:
            if not engine.has_unfinished_requests():
                raise RuntimeError(f"the batch finished after {decode_steps() - start} of {n} decode steps")
            each()
        return decode_steps() - start

    try:
        seqs = [s for rid in ids for s in engine.requests[rid].seqs]
        while any(s.num_output_tokens == 0 for s in seqs):
            engine.step()  # prefills, and the first token of every sequence
        run(warmup)
        _sync(device)
        t0 = time.perf_counter()
        timed = run(num_steps)
        _sync(device)
        wall_ms = (time.perf_counter() - t0) * 1e3 / timed

        def step():
            with record_function(STEP):
                engine.step()

        with profile(activities=activities) as prof:
            profiled = run(num_steps, step)
            _sync(device)
    finally:
        engine.abort_request(ids)
    return wall_ms, prof, profiled


def _profile_mirrored(llm, batch, prompt_len, max_tokens, num_steps, warmup, seed, activities):
    """Tensor parallel with spawned ranks: every rank must run the same steps, so the batch goes
    through `llm.generate` (which they mirror) and this rank's steps are timed, then profiled, from
    inside. The profile is rank 0's: its kernels, all-reduces included."""
    from tandem.sampling_params import SamplingParams

    engine = llm.llm_engine
    rng = random.Random(seed)
    hi = min(engine.hf_config.vocab_size, 32000) - 1
    prompts = [[rng.randint(100, hi) for _ in range(prompt_len)] for _ in range(batch)]
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    # prefill steps, then `warmup` decode steps, are left out
    skip = -(-batch * prompt_len // engine.config.max_num_batched_tokens) + warmup
    run_step = engine.step
    times: list[float] = []

    def timed():
        t = time.perf_counter()
        out = run_step()
        times.append(time.perf_counter() - t)
        return out

    engine.step = timed
    try:
        llm.generate(prompts, params, use_tqdm=False)
        wall_ms = 1e3 * sum(times[skip : skip + num_steps]) / num_steps
        sched = torch.profiler.schedule(skip_first=skip, wait=0, warmup=1, active=num_steps, repeat=1)
        with profile(activities=activities, schedule=sched) as prof:
            def profiled():
                with record_function(STEP):
                    out = run_step()
                prof.step()
                return out

            engine.step = profiled
            llm.generate(prompts, params, use_tqdm=False)
    finally:
        del engine.step  # the class's method again
    return wall_ms, prof


def print_profile(r: dict) -> None:
    if r.get("kind") == "prefill":
        line = (f"prefill profile: {r['batch']} prompts of {r['prompt_len']} tokens a step "
                f"({r['tokens_per_step']} tokens), {r['num_steps']} steps | wall {r['wall_ms']:.2f} ms/step")
        if "floor_ms" in r:
            line += (f" (GEMM floor {r['floor_ms']:.2f} ms, {100 * r['floor_fraction']:.0f}% of it)")
    else:
        line = (f"decode profile: batch {r['batch']}, prompt {r['prompt_len']}, "
                f"{r['num_steps']} steps | wall {r['wall_ms']:.2f} ms/step")
        if "ceiling_ms" in r:
            line += f" (ceiling {r['ceiling_ms']:.2f} ms, {100 * r['roofline_fraction']:.0f}% of it)"
    print(line)
    print(f"  under the profiler: step {r['step_ms']:.2f} ms = host busy {r['host_busy_ms']:.2f}"
          f" + waiting on the GPU {r['host_wait_ms']:.2f}")
    if "gpu_busy_ms" in r:
        print(f"  GPU kernels {r['gpu_busy_ms']:.2f} ms/step ({r['kernels_per_step']:.0f} kernels);"
              f" GPU idle {max(0.0, r['step_ms'] - r['gpu_busy_ms']):.2f} ms/step")
        print(f"  {'category':<18}{'ms/step':>9}{'share':>8}")
        for name, c in r["categories"].items():
            print(f"  {name:<18}{c['ms_per_step']:>9.3f}{100 * c['share']:>7.1f}%")
        print(f"  {'kernel':<72}{'ms/step':>9}{'calls':>7}{'share':>8}")
        for k in r["top_kernels"]:
            print(f"  {k['name'][:72]:<72}{k['ms_per_step']:>9.3f}{k['calls_per_step']:>7.0f}"
                  f"{100 * k['share']:>7.1f}%")
    else:
        print(f"  {'host op (self time)':<60}{'ms/step':>9}")
        for k in r["top_cpu_ops"]:
            print(f"  {k['name'][:60]:<60}{k['ms_per_step']:>9.3f}")
