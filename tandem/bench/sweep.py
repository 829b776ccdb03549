"""`tandem bench sweep`: loads from one-at-a-time to saturation, and the sweet spot among them.

Rate mode follows GuideLLM's sweep: a synchronous run (concurrency 1) and a throughput run (all
at once) measure the lowest and highest request rates, then `sweep_size - 2` rates evenly in
between (the last one the throughput rate). Concurrency mode runs a list of fixed concurrencies.
With `launch`, the server is started for every (max_num_seqs, max_num_batched_tokens) grid
point. The sweet spot is the highest output throughput whose p99 TTFT and p99 TPOT meet the SLO.
With `serve.num_runs` > 1 (`--num-runs`) each point is the median of that many runs of its load,
each with prompts of its own (`serve_runs.run_series`).
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

from tandem.bench import report as rp
from tandem.bench.load import LoadConfig
from tandem.bench.metrics import parse_slo
from tandem.bench.serve import ServeConfig
from tandem.bench.serve_runs import run_series

MODES = ("rate", "concurrency")
MAX_FAILED_FRAC = 0.01  # a point that drops more requests than this cannot be the sweet spot


@dataclass
class SweepConfig:
    """The series of loads (and optionally of server launches) to run."""

    serve: ServeConfig = field(default_factory=ServeConfig)  # base point: target, prompts, SLO
    mode: str = "rate"  # rate (GuideLLM's sweep) | concurrency (a list of fixed concurrencies)
    sweep_size: int = 10  # rate mode: synchronous + throughput + (sweep_size - 2) rates
    sweep_rate_type: str = "constant"  # rate mode: constant (GuideLLM's default) | poisson
    sync_prompts: int = 32  # rate mode: requests in the synchronous run
    concurrencies: str = "1,2,4,8,16,32,64,128,256"
    prompts_per_concurrency: int | None = None  # concurrency mode: at least c * this requests
    launch: str | None = None  # "CMD ... {max_num_seqs} {max_num_batched_tokens} [{port}]"
    max_num_seqs: str = "256"  # launch grid, comma-separated
    max_num_batched_tokens: str = "8192"
    health_timeout_s: float = 600.0
    num_gpus: int | None = None  # the server's GPUs, for tok/s per GPU; None: gpu_indices or 1
    output_dir: str | None = None  # sweep.json, sweep.csv, report.md, *.png, server logs

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.sweep_size < 2:
            raise ValueError(
                f"sweep_size must be >= 2 (synchronous + throughput), got {self.sweep_size}"
            )
        LoadConfig(rate_type=self.sweep_rate_type)  # validates the name
        _ints(self.concurrencies, "concurrencies")
        if self.launch:
            _ints(self.max_num_seqs, "max_num_seqs")
            _ints(self.max_num_batched_tokens, "max_num_batched_tokens")


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{name} must be comma-separated integers >= 1, got {text!r}")
    return values


def run_sweep(cfg: SweepConfig, show_progress: bool = True) -> dict:
    """Run every grid point's series of loads; report kind 'sweep'."""
    grid = [(None, None)]
    if cfg.launch:
        grid = [
            (s, b)
            for s in _ints(cfg.max_num_seqs, "max_num_seqs")
            for b in _ints(cfg.max_num_batched_tokens, "max_num_batched_tokens")
        ]
    points, failures, gpu = [], [], {"available": False, "reason": "no point measured"}
    for k, (seqs, tokens) in enumerate(grid):
        grid_point = {"max_num_seqs": seqs, "max_num_batched_tokens": tokens} if seqs else None
        try:
            with _server(cfg, seqs, tokens, k) as base_url:
                serve = replace(cfg.serve, target=replace(cfg.serve.target, base_url=base_url))
                for p in _series(cfg, serve, show_progress):
                    p["grid"] = grid_point
                    gpu = p["gpu"]
                    points.append(p)
                    if show_progress:
                        _say(p)
        except (RuntimeError, OSError) as e:
            failures.append({"grid": grid_point, "error": str(e)[-2000:]})
    watched = cfg.serve.gpu_indices
    num_gpus = cfg.num_gpus or (len(watched.split(",")) if watched else 1)
    slo = parse_slo(cfg.serve.slo)
    for p in points:
        p["output_tok_s_per_gpu"] = p["output_throughput"] / num_gpus
        p["meets_slo"] = meets_slo(p, slo)
    results = {
        "num_gpus": num_gpus,
        "slo_ms": slo or None,
        "points": points,
        "sweet_spot": sweet_spot(points),
        "pareto": pareto_front(points),
        "grid_failures": failures,
    }
    report = rp.make_report("sweep", cfg, results, gpu)
    if cfg.output_dir:
        write_outputs(report, cfg.output_dir)
    return report


def _series(cfg: SweepConfig, base: ServeConfig, show_progress: bool) -> Iterator[dict]:
    """The loads of one sweep, each yielded as a point as soon as it is measured. With
    `base.num_runs` > 1 a point is the median of that many runs (`run_series`)."""
    n = base.dataset.num_prompts

    def run(label: str, strategy: str, load: LoadConfig, prompts: int, i: int) -> dict:
        # point i's runs draw seeds seed + i * num_runs, ...: no prompt repeats across points or
        # runs, so no prefix-cache hit carries over
        seed = base.dataset.seed + i * base.num_runs
        point_cfg = replace(
            base,
            load=load,
            label=label,
            output_dir=None,
            num_warmups=base.num_warmups if i == 0 else 0,
            dataset=replace(base.dataset, num_prompts=prompts, seed=seed),
            # a load of concurrency c needs no more than c client processes
            num_client_processes=None if base.num_client_processes is None else min(
                base.num_client_processes, load.max_concurrency or base.num_client_processes),
        )
        report = run_series(point_cfg, show_progress)
        return _point(label, strategy, load, report)

    load0 = replace(base.load, request_rate=math.inf, max_concurrency=None)
    if cfg.mode == "concurrency":
        for i, c in enumerate(_ints(cfg.concurrencies, "concurrencies")):
            prompts = max(n, c * (cfg.prompts_per_concurrency or 0), c)
            yield run(
                f"concurrency {c}", "concurrency", replace(load0, max_concurrency=c), prompts, i
            )
        return
    sync = run(
        "synchronous", "synchronous", replace(load0, max_concurrency=1), min(n, cfg.sync_prompts), 0
    )
    yield sync
    thr_load = replace(load0, max_concurrency=base.load.max_concurrency)
    thr = run("throughput", "throughput", thr_load, n, 1)
    yield thr
    lo, hi = sync["request_throughput"], thr["request_throughput"]
    for i, rate in enumerate(np.linspace(lo, hi, cfg.sweep_size - 1)[1:].tolist(), start=2):
        load = replace(thr_load, request_rate=rate, rate_type=cfg.sweep_rate_type)
        yield run(f"rate {rate:.3g}/s", "rate", load, n, i)


def _say(p: dict) -> None:
    """One line per measured load on stderr, so a long sweep shows where it is."""
    grid = (
        f"[{p['grid']['max_num_seqs']}/{p['grid']['max_num_batched_tokens']}] " if p["grid"] else ""
    )
    rp.console(stderr=True).print(
        f"{grid}{p['label']}: {p['request_throughput']:.2f} req/s, "
        f"{p['output_throughput']:,.0f} out tok/s, TTFT p99 {rp.fmt(p['ttft_ms']['p99'], 1)} ms, "
        f"TPOT p99 {rp.fmt(p['tpot_ms']['p99'], 1)} ms, failed {p['failed']}",
        markup=False,
        highlight=False,
    )


def _point(label: str, strategy: str, load: LoadConfig, report: dict) -> dict:
    r = report["results"]
    tpot50 = r["tpot_ms"]["median"]
    gpu = report["gpu"]
    return {
        "label": label,
        "strategy": strategy,
        "model": report["config"]["target"]["model"],
        "target_rate": None if math.isinf(load.request_rate) else load.request_rate,
        "max_concurrency": load.max_concurrency,
        "completed": r["completed"],
        "failed": r["failed"],
        "duration_s": r["duration_s"],
        "request_throughput": r["request_throughput"],
        "output_throughput": r["output_throughput"],
        "goodput": r["goodput"],
        "max_in_flight": r["max_in_flight"],
        "ttft_ms": r["ttft_ms"],
        "tpot_ms": r["tpot_ms"],
        "itl_ms": r["itl_ms"],
        "e2el_ms": r["e2el_ms"],
        "output_tok_s_per_user": 1000.0 / tpot50 if tpot50 else None,
        "gpu_util_mean": gpu.get("util_mean"),
        "client_warning": r["client"]["warning"],
        "errors": r["errors"],
        "gpu": rp.compact(gpu),  # this load's GPU summary (samples left out)
        "runs": r.get("runs"),  # with num_runs > 1: every run's figures and their spread
    }


def meets_slo(point: dict, slo: dict[str, float]) -> bool:
    """p99 of each SLO'd metric within its limit, and (almost) no failed requests."""
    total = point["completed"] + point["failed"]
    if not point["completed"] or point["failed"] > MAX_FAILED_FRAC * total:
        return False
    for key, limit in slo.items():
        p99 = point[f"{key}_ms"]["p99"]
        if p99 is not None and p99 > limit:
            return False
    return True


def sweet_spot(points: list[dict]) -> dict | None:
    """The highest output throughput among the points that meet the SLO."""
    ok = [i for i, p in enumerate(points) if p["meets_slo"]]
    if not ok:
        return None
    best = max(ok, key=lambda i: points[i]["output_throughput"])
    return {
        "index": best,
        "label": points[best]["label"],
        "grid": points[best]["grid"],
        "output_throughput": points[best]["output_throughput"],
        "ttft_p99_ms": points[best]["ttft_ms"]["p99"],
        "tpot_p99_ms": points[best]["tpot_ms"]["p99"],
    }


def pareto_front(points: list[dict]) -> list[int]:
    """Indices of points no other point beats on both tok/s per user and tok/s per GPU."""
    pts = [
        (p["output_tok_s_per_user"], p["output_tok_s_per_gpu"], i)
        for i, p in enumerate(points)
        if p["output_tok_s_per_user"]
    ]
    front, best_gpu = [], -1.0
    for _user, gpu, i in sorted(pts, key=lambda t: (-t[0], -t[1])):
        if gpu > best_gpu:
            front.append(i)
            best_gpu = gpu
    return front


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _server(cfg: SweepConfig, seqs: int | None, tokens: int | None, k: int) -> Iterator[str]:
    """The base URL to load: the configured one, or a server launched for this grid point."""
    if not cfg.launch:
        yield cfg.serve.target.base_url
        return
    url = urlparse(cfg.serve.target.base_url)
    port = free_port() if "{port}" in cfg.launch else url.port or 80
    base_url = f"{url.scheme}://{url.hostname}:{port}"
    cmd = (
        cfg.launch.replace("{max_num_seqs}", str(seqs))
        .replace("{max_num_batched_tokens}", str(tokens))
        .replace("{port}", str(port))
    )
    log_dir = Path(cfg.output_dir or ".")
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"server_{k}_seqs{seqs}_tokens{tokens}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, shell=True, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )  # its own group: we stop all it starts
        try:
            wait_for_health(base_url, proc, cfg.health_timeout_s, log_path)
            yield base_url
        finally:
            _stop(proc)


def wait_for_health(
    base_url: str, proc: subprocess.Popen | None, timeout_s: float, log_path: Path | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log_path.read_text()[-1500:] if log_path else ""
            raise RuntimeError(f"server exited with code {proc.returncode} before /health:\n{tail}")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{base_url}/health not ready after {timeout_s:g}s")


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue


def write_outputs(report: dict, out_dir: str) -> None:
    from tandem.bench.sweep_report import plot_latency_vs_load, plot_pareto, write_markdown

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rp.write_json(report, out / "sweep.json")
    rows = [
        rp.flatten({k: v for k, v in p.items() if k != "errors"})
        for p in report["results"]["points"]
    ]
    rp.write_csv(rows, out / "sweep.csv")
    plot_latency_vs_load(report, out / "latency_vs_load.png")
    plot_pareto(report, out / "pareto.png")
    write_markdown(report, out / "report.md")
