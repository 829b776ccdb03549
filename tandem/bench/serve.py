"""`tandem bench serve`: online load against any OpenAI-compatible server, vLLM's metrics.

Builds the prompts, warms the server up, sends the load (in this process, or split over
`num_client_processes` spawned processes sharing one arrival schedule) while the GPU monitor
samples, then summarises TTFT/TPOT/ITL/E2E, throughputs, goodput, failures and the client's
own load, so a client bottleneck shows instead of passing for a slow server.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import os
import queue
import time
import traceback
from dataclasses import dataclass, field, replace

from tandem.bench import report as rp
from tandem.bench.client import (
    TargetConfig,
    build_payload,
    max_model_len,
    resolve_model,
    run_requests,
)
from tandem.bench.datasets import DatasetConfig, RequestSpec, load_requests
from tandem.bench.gpu_monitor import GpuMonitor
from tandem.bench.load import (
    REQUESTS_PER_CLIENT_PROCESS,
    LoadConfig,
    arrival_offsets,
    auto_client_processes,
    split_concurrency,
    split_for_workers,
)
from tandem.bench.metrics import (
    RequestRecord,
    distribution,
    inflight_timeline,
    parse_slo,
    per_request_rows,
    summarize,
)
from tandem.bench.server_metrics import QueueSampler, over_run, queue_rows, scrape, server_rows
from tandem.engine.gc_pause import frozen_heap

CLIENT_CPU_WARN = 0.85  # a client process this busy (share of one core) distorts latencies
SCHEDULE_LAG_WARN_MS = 20.0
IDLE_WARN_FRAC = 0.2  # GPU idle in more than this share of busy samples: say so


@dataclass
class ServeConfig:
    """One load test: target, prompts, arrival process, and how the client runs."""

    target: TargetConfig = field(default_factory=TargetConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    num_warmups: int = 1  # requests sent (and discarded) before the measured run
    slo: str | None = None  # "ttft=1000,tpot=50" in ms: goodput counts requests meeting all
    num_client_processes: int | None = None  # None: auto_client_processes (a burst's share)
    gpu_monitor: bool = True
    gpu_interval_s: float = 0.1
    gpu_indices: str | None = None  # NVML indices to watch, "0,1"; None: all
    idle_util_pct: float = 10.0  # "GPU idle" below this utilization while requests are in flight
    queue_sampler: bool = True  # sample the server's running/waiting gauges at /metrics
    queue_interval_s: float = 0.1
    ceiling_output_tok_s: float | None = None  # roofline figure, to print the fraction of it
    output_dir: str | None = None  # requests.csv and timeline.png (in flight vs GPU util)
    label: str = ""
    num_runs: int = 1  # the measured load this many times, each with its own prompts (serve_runs)

    def __post_init__(self) -> None:
        parse_slo(self.slo)  # raises with the reason
        if self.num_client_processes is not None and self.num_client_processes < 1:
            raise ValueError(
                f"num_client_processes must be >= 1 (or unset: one per {REQUESTS_PER_CLIENT_PROCESS} "
                f"requests sent at once), got {self.num_client_processes}")
        split_concurrency(self.load.max_concurrency, self.client_processes())
        if self.num_warmups < 0:
            raise ValueError(f"num_warmups must be >= 0, got {self.num_warmups}")
        if not self.gpu_interval_s > 0:
            raise ValueError(f"gpu_interval_s must be > 0, got {self.gpu_interval_s}")
        if not self.queue_interval_s > 0:
            raise ValueError(f"queue_interval_s must be > 0, got {self.queue_interval_s}")
        if isinstance(self.num_runs, bool) or not isinstance(self.num_runs, int) or self.num_runs < 1:
            raise ValueError(f"num_runs must be an int >= 1, got {self.num_runs!r}")

    def client_processes(self) -> int:
        """The client processes this run uses: as given, else one per burst share (load.py)."""
        if self.num_client_processes is not None:
            return self.num_client_processes
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return auto_client_processes(self.dataset.num_prompts, self.load, cpus or 1)


def run_benchmark(cfg: ServeConfig, show_progress: bool = True) -> dict:
    """Run the load test and return the report (schema tandem.bench/1, kind 'serve')."""
    specs = load_requests(cfg.dataset)
    model = resolve_model(cfg.target)
    cfg = replace(cfg, target=replace(cfg.target, model=model))
    check_context(specs, max_model_len(cfg.target, model), cfg.target.base_url)
    bodies = [build_payload(s, cfg.target, model) for s in specs]
    warmup(cfg, specs)
    records = [RequestRecord(i, s.prompt_len, s.output_len) for i, s in enumerate(specs)]
    offsets = arrival_offsets(len(records), cfg.load)
    indices = [int(i) for i in cfg.gpu_indices.split(",")] if cfg.gpu_indices else None
    bar, task = rp.progress(len(records), cfg.label or "bench serve", enabled=show_progress)

    def tick(n: int = 1) -> None:
        bar.update(task, advance=n)

    counters = scrape(cfg.target)  # the server's own, before the load (after the warm-up)
    # frozen_heap: a full GC pass over the client's heap (transformers, the prompts) would stall
    # its event loop for tens of ms and show up as the server's inter-token latency
    queue = QueueSampler(cfg.target, cfg.queue_interval_s, enabled=cfg.queue_sampler)
    with bar, GpuMonitor(cfg.gpu_interval_s, indices, enabled=cfg.gpu_monitor) as mon, queue, frozen_heap():
        workers = cfg.client_processes()
        if workers == 1:
            sent, t0, cpu = _run_in_process(cfg, bodies, records, offsets, tick)
        else:
            sent, t0, cpu = _run_in_processes(cfg, bodies, records, offsets, tick, workers)
    results = summarize(sent, t0, parse_slo(cfg.slo))
    # the run's start on CLOCK_MONOTONIC (time.perf_counter on Linux): server-side timestamps
    # taken on the same host line up with the per-request times, which count from it
    results["start_monotonic_s"] = t0
    results["server"] = over_run(counters, scrape(cfg.target) if counters is not None else None)
    results["client"] = _client_stats(cfg, sent, cpu, results["duration_s"])
    timeline = inflight_timeline(sent)
    results["server_queue"] = queue.summary(timeline, (t0, t0 + results["duration_s"]))
    queue_series = queue.series(t0, t0 + results["duration_s"])
    if results["server_queue"] is not None:
        results["server_queue"]["series"] = queue_series
    results["gpu_idle_while_busy"] = mon.idle_while_busy(timeline, cfg.idle_util_pct)
    if cfg.ceiling_output_tok_s:
        ceiling = cfg.ceiling_output_tok_s
        results["output_throughput_of_ceiling"] = results["output_throughput"] / ceiling
    results["prompt_lengths_approximate"] = any(s.approx_len for s in specs)
    results["requests"] = per_request_rows(sent)
    gpu = mon.summary(window=(t0, t0 + results["duration_s"]))  # the load's span only
    if mon.available:
        gpu["samples"] = mon.samples_json()
    if cfg.output_dir:
        rp.write_csv(results["requests"], f"{cfg.output_dir}/requests.csv")
        util = [[r["util"] for r in dev] for dev in mon.samples]
        rp.plot_timeline(f"{cfg.output_dir}/timeline.png", timeline, mon.times, util, t0,
                         queue=queue_series)
    return rp.make_report("serve", cfg, results, gpu)


def warmup(cfg: ServeConfig, specs: list[RequestSpec]) -> None:
    """Send a few requests first; if every one fails, stop with the server's answer. Their
    prompts start differently from the measured ones, so no prefix-cache hit carries over."""
    if cfg.num_warmups == 0:
        return
    picks = [
        build_payload(replace(s, prompt="Warm-up. " + s.prompt), cfg.target, cfg.target.model)
        for s in (specs[i % len(specs)] for i in range(cfg.num_warmups))
    ]
    recs = [RequestRecord(-1 - i) for i in range(len(picks))]
    sent, _ = asyncio.run(run_requests(cfg.target, picks, recs, [0.0] * len(picks)))
    if not any(r.ok for r in sent):
        url = cfg.target.base_url + cfg.target.endpoint
        error = sent[0].error
        hint = ""
        if (cfg.target.ignore_eos and error.startswith("HTTP 4")
                and ("ignore_eos" in error or "min_tokens" in error)):
            hint = "; the server refuses ignore_eos/min_tokens: rerun with --no-ignore-eos"
        raise RuntimeError(f"warm-up request to {url} failed: {error}{hint}")


def check_context(specs: list[RequestSpec], model_len: int | None, base_url: str) -> None:
    """Before sending anything: every request must fit the server's context (prompt + output
    <= max_model_len), else say which do not and what would fit. Approximate prompt lengths
    (no tokenizer) get 10% slack."""
    if model_len is None:
        return
    def need(s: RequestSpec) -> float:
        return (s.prompt_len / 1.1 if s.approx_len else s.prompt_len) + s.output_len

    too_long = [s for s in specs if need(s) > model_len]
    if too_long:
        worst = max(too_long, key=need)
        raise RuntimeError(
            f"{len(too_long)} of {len(specs)} requests do not fit {base_url}'s max_model_len "
            f"({model_len}): the longest has a {worst.prompt_len}-token prompt and "
            f"{worst.output_len} output tokens; lower --input-len/--output-len so that their sum "
            f"is at most {model_len}"
        )


def _run_in_process(cfg, bodies, records, offsets, tick):
    cpu0 = time.process_time()
    sent, t0 = asyncio.run(
        run_requests(
            cfg.target,
            bodies,
            records,
            offsets,
            cfg.load.max_concurrency,
            max_seconds=cfg.load.max_seconds,
            on_done=lambda _: tick(),
        )
    )
    return sent, t0, [time.process_time() - cpu0]


def _worker(target, bodies, records, offsets, max_conc, max_seconds, conn, results, counter):
    """One client process: wait for the common start time, run its share, send records back."""
    try:
        conn.send("ready")
        t0 = conn.recv()
        cpu0 = time.process_time()

        def done(_):
            with counter.get_lock():
                counter.value += 1

        with frozen_heap():
            sent, _ = asyncio.run(
                run_requests(target, bodies, records, offsets, max_conc, t0, max_seconds, done)
            )
        results.put(("ok", sent, time.process_time() - cpu0))
    except BaseException:  # report, don't hang the parent
        results.put(("error", traceback.format_exc(), 0.0))


def _run_in_processes(cfg, bodies, records, offsets, tick, workers: int):
    """Split one schedule round-robin over spawned processes; they share t0 (CLOCK_MONOTONIC,
    which perf_counter reads on Linux, is the same clock in every process)."""
    ctx = mp.get_context("spawn")
    shares = split_for_workers(len(records), workers)
    concs = split_concurrency(cfg.load.max_concurrency, len(shares))
    results, counter, procs, conns = ctx.Queue(), ctx.Value("i", 0), [], []
    for idx, conc in zip(shares, concs):
        parent, child = ctx.Pipe()
        args = (
            cfg.target,
            [bodies[i] for i in idx],
            [records[i] for i in idx],
            [offsets[i] for i in idx],
            conc,
            cfg.load.max_seconds,
            child,
            results,
            counter,
        )
        procs.append(ctx.Process(target=_worker, args=args, daemon=True))
        procs[-1].start()
        conns.append(parent)
    for c, p in zip(conns, procs):
        while not c.poll(0.1):  # a process that dies importing must not hang us
            if not p.is_alive():
                raise RuntimeError(f"client process exited with code {p.exitcode} at start")
        c.recv()
    t0 = time.perf_counter() + 0.05
    for c in conns:
        c.send(t0)
    sent, cpu, shown = [], [], 0
    while len(cpu) < len(procs):
        try:
            status, payload, cpu_s = results.get(timeout=0.1)
        except queue.Empty:
            if not any(p.is_alive() for p in procs):
                raise RuntimeError("a client process died without a result") from None
        else:
            if status != "ok":
                raise RuntimeError(f"client process failed:\n{payload}")
            sent += payload
            cpu.append(cpu_s)
        tick(counter.value - shown)
        shown = counter.value
    for p in procs:
        p.join()
    return sorted(sent, key=lambda r: r.index), t0, cpu


def _client_stats(cfg: ServeConfig, sent: list[RequestRecord], cpu: list[float], dur: float):
    util = [c / dur for c in cpu]
    lag = distribution([r.t_dispatched - r.t_scheduled for r in sent])
    stats = {
        "processes": len(cpu),
        "cpu_s": sum(cpu),
        "cpu_util_max_process": max(util, default=0.0),  # 1.0 = one core fully busy
        "schedule_lag_ms": lag,
        "queue_ms": distribution([r.t_start - r.t_dispatched for r in sent]),
        "warning": None,
    }
    rated = not math.isinf(cfg.load.request_rate)
    if stats["cpu_util_max_process"] > CLIENT_CPU_WARN or (
        rated and (lag["p99"] or 0.0) > SCHEDULE_LAG_WARN_MS
    ):
        stats["warning"] = (
            "the client may be the bottleneck (busy CPU or late sends): "
            f"rerun with --num-client-processes {2 * len(cpu)}"
        )
    return stats


def print_report(report: dict) -> None:
    """The human table: vLLM's result block plus client and GPU sections."""
    from rich.markup import escape

    res, cfg, gpu = report["results"], report["config"], report["gpu"]
    approx = (
        " (approx.)"
        if res.get("prompt_lengths_approximate") and not res["output_tokens_from_usage"]
        else ""
    )
    tput = [
        ("Request throughput (req/s)", res["request_throughput"]),
        ("Output token throughput (tok/s)", res["output_throughput"]),
    ]
    if res.get("output_throughput_of_ceiling") is not None:
        tput.append(("  fraction of ceiling", res["output_throughput_of_ceiling"]))
    tput += [
        ("Peak output throughput (tok/s)", res["peak_output_throughput"]),
        ("Total token throughput (tok/s)", res["total_token_throughput"]),
        ("Max requests in flight", res["max_in_flight"]),
    ]
    if res["goodput"] is not None:
        slo = ", ".join(f"{k}<={v:g}ms" for k, v in res["slo_ms"].items())
        tput.append((f"Goodput (req/s) [{slo}]", res["goodput"]))
    counts = [
        ("Successful requests", res["completed"]),
        ("Failed requests", res["failed"]),
        ("Duration (s)", res["duration_s"]),
        ("Total input tokens" + approx, res["total_input_tokens"]),
        ("Total output tokens", res["total_output_tokens"]),
    ]
    sections = [("", [*counts, *tput])]
    for key, name in (
        ("ttft_ms", "Time to first token"),
        ("tpot_ms", "Time per output token"),
        ("itl_ms", "Inter-token latency"),
        ("e2el_ms", "End-to-end latency"),
    ):
        d = res[key]
        sections.append((f"{name} (ms)", [(s, d[s]) for s in ("mean", "median", "p90", "p99")]))
    rs = res.get("response_start_ms")
    if rs and rs.get("median") is not None:
        sections.append((
            "Response start (ms): sent -> headers (client, wire, API server)",
            [*((k, rs[k]) for k in ("median", "p99", "max")),
             ("first request's (s after the start)", res["first_response_start_s"]),
             ("last request's (s after the start)", res["last_response_start_s"]),
             ("the run's first token (s after the start)", res["first_token_s"])],
        ))
    cl = res["client"]
    sections.append(
        (
            "Client",
            [
                ("processes", cl["processes"]),
                ("CPU busy (of one core, busiest process)", cl["cpu_util_max_process"]),
                ("schedule lag p99 (ms)", cl["schedule_lag_ms"]["p99"]),
            ],
        )
    )
    sections.append(("GPU", gpu_rows(gpu, res.get("gpu_idle_while_busy"))))
    sections.append(("Server (its /metrics over the run)", server_rows(res.get("server"))))
    if cfg.get("queue_sampler", True):
        sections.append(("Server queue (its /metrics while requests were in flight)",
                         queue_rows(res.get("server_queue"))))
    load = LoadConfig(**cfg["load"]).describe()
    title = f"bench serve: {cfg['target']['base_url']}{cfg['target']['endpoint']}, {load}"
    rp.print_kv(title, sections)
    out = rp.console()
    for e in res["errors"]:
        out.print(f"[red]error x{e['count']}:[/red] {escape(e['error'])}")
    if cl["warning"]:
        out.print(f"[yellow]warning:[/yellow] {escape(cl['warning'])}")
    idle = res.get("gpu_idle_while_busy") or {}
    if (idle.get("idle_while_busy_frac") or 0.0) > IDLE_WARN_FRAC:
        out.print(
            f"[yellow]warning:[/yellow] the GPU was idle (<{idle['threshold_pct']:g}% util) in "
            f"{idle['idle_while_busy_frac']:.0%} of samples while requests were in flight: "
            "something else (server CPU, I/O, the client) held it back"
        )


def gpu_rows(gpu: dict, idle: dict | None = None) -> list[tuple[str, object]]:
    """Summary rows for any bench table; 'no GPU' and why, when there was none."""
    if not gpu.get("available"):
        return [("status", gpu.get("reason") or "no GPU")]
    rows: list[tuple[str, object]] = [("sample rate (Hz)", gpu.get("sample_hz"))]
    for d in gpu["devices"]:
        p = f"gpu{d['index']} "
        rows += [
            (
                p + "util mean / median (%)",
                f"{rp.fmt(d['util_mean'], 1)} / {rp.fmt(d['util_median'], 1)}",
            ),
            (p + "samples >= 90% util", d.get("util_ge90_frac")),
            (
                p + "SM active / DRAM bw (%)",
                f"{rp.fmt(d['sm_active_mean'], 1)} / {rp.fmt(d['dram_bw_util_mean'], 1)}",
            ),
            (
                p + "mem used max (GB) / power (W)",
                f"{rp.fmt(d['mem_used_max_gb'], 1)} / {rp.fmt(d['power_w_mean'], 0)}",
            ),
        ]
    if idle and idle.get("idle_while_busy_frac") is not None:
        rows.append(
            (
                f"idle (<{idle['threshold_pct']:g}%) while requests in flight",
                idle["idle_while_busy_frac"],
            )
        )
    return rows
