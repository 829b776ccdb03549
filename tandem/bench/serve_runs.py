"""`tandem bench serve --num-runs N`: the same load N times against one server, and its spread.

One burst's throughput moves by several percent from run to run on the same server (on an H200,
1,024 requests at once: 64,934 to 73,544 output tok/s, 2026-12-04), so a figure worth quoting is
a median over runs. As aiperf's `--num-profile-runs`, the warm-up goes before the first run only;
unlike it, every run draws its own prompts (seed, seed + 1, ...): the same prompts again would
hit the server's prefix cache (vLLM's and tandem's are on by default) and measure another
workload. The report is the run of median output throughput in full, with every run's headline
figures and their median, range and coefficient of variation under `results["runs"]`. A run that
fails after the first ends the series: the runs done are reported, the error with them.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import replace

from tandem.bench import report as rp
from tandem.bench.serve import ServeConfig, run_benchmark

# (results key, statistic) of the figures compared across runs; None: the key is the figure
RUN_FIGURES = (
    ("output_throughput", None),
    ("request_throughput", None),
    ("duration_s", None),
    ("ttft_ms", "median"),
    ("ttft_ms", "p99"),
    ("tpot_ms", "median"),
    ("itl_ms", "median"),
    ("itl_ms", "p99"),
    ("e2el_ms", "median"),
)


def figure_name(key: str, stat: str | None) -> str:
    return key if stat is None else f"{stat}_{key}"


def run_series(cfg: ServeConfig, show_progress: bool = True) -> dict:
    """`cfg.num_runs` measured loads, one after another; one run is `run_benchmark`'s report."""
    if cfg.num_runs == 1:
        return run_benchmark(cfg, show_progress)
    reports, error = [], None
    for i in range(cfg.num_runs):
        run = replace(
            cfg,
            dataset=replace(cfg.dataset, seed=cfg.dataset.seed + i),
            load=replace(cfg.load, seed=cfg.load.seed + i),
            num_warmups=cfg.num_warmups if i == 0 else 0,
            output_dir=cfg.output_dir and os.path.join(cfg.output_dir, f"run_{i + 1:02d}"),
            label=f"{cfg.label or 'bench serve'}: run {i + 1} of {cfg.num_runs}",
            num_runs=1,
        )
        try:
            reports.append(run_benchmark(run, show_progress))
        except (RuntimeError, OSError) as e:  # the server gone mid-series: keep the runs done
            if not reports:
                raise
            error = f"run {i + 1} of {cfg.num_runs}: {type(e).__name__}: {e}"
            break
    by_throughput = sorted(range(len(reports)),
                           key=lambda i: reports[i]["results"]["output_throughput"])
    median_run = by_throughput[(len(reports) - 1) // 2]  # the lower one of an even count
    runs = summarize_runs(reports, median_run)
    runs["error"] = error  # why the series stopped short, or None
    report = reports[median_run]
    report["config"] = rp.report_config(cfg)  # the series', not the run's
    report["results"]["runs"] = runs
    return report


def summarize_runs(reports: list[dict], median_run: int) -> dict:
    """Each run's headline figures, and across runs each figure's median, mean, min, max and
    coefficient of variation (sample standard deviation over mean)."""
    per_run = []
    for report in reports:
        res = report["results"]
        row = {"seed": report["config"]["dataset"]["seed"], "completed": res["completed"],
               "failed": res["failed"]}
        for key, stat in RUN_FIGURES:
            row[figure_name(key, stat)] = res[key] if stat is None else res[key][stat]
        per_run.append(row)
    stats = {}
    for key, stat in RUN_FIGURES:
        name = figure_name(key, stat)
        values = [row[name] for row in per_run if row[name] is not None]
        if not values:
            continue
        mean = statistics.fmean(values)
        cv = statistics.stdev(values) / abs(mean) if len(values) > 1 and mean else None
        stats[name] = {"median": statistics.median(values), "mean": mean, "min": min(values),
                       "max": max(values), "cv": cv}
    return {"num_runs": len(reports), "reported_run": median_run + 1, "per_run": per_run,
            "stats": stats}


def print_runs(report: dict) -> None:
    """The runs' table under `print_report`'s, when the report holds more than one run."""
    runs = report["results"].get("runs")
    if not runs:
        return
    cols = [("output_throughput", "out tok/s"), ("median_ttft_ms", "TTFT median (ms)"),
            ("p99_ttft_ms", "TTFT p99 (ms)"), ("median_tpot_ms", "TPOT median (ms)"),
            ("duration_s", "duration (s)")]
    rows = [[f"{i + 1} (seed {r['seed']})", *(r[k] for k, _ in cols), r["failed"]]
            for i, r in enumerate(runs["per_run"])]
    for name in ("median", "min", "max", "cv"):
        rows.append([name, *(runs["stats"].get(k, {}).get(name) for k, _ in cols), None])
    which = "the median" if runs["num_runs"] % 2 else "the lower of the two middle ones"
    rp.print_rows(
        f"{runs['num_runs']} runs (the tables above: run {runs['reported_run']}, {which} by "
        "output tok/s)", ["run", *(title for _, title in cols), "failed"], rows)
    if runs.get("error"):
        from rich.markup import escape

        rp.console().print(f"[red]the series stopped at {escape(runs['error'])}[/red]")
