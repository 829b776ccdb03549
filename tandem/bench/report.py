"""One versioned result schema for every bench command, and the ways results leave the process:
a rich table for people, one closing line of JSON for machines, a JSON file, CSV rows.

    {"schema": "tandem.bench/1", "kind": ..., "config": ..., "results": ..., "gpu": ..., "env": ...}
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

SCHEMA = "tandem.bench/1"
BULKY_KEYS = ("requests", "samples")
SECRET = "<redacted>"  # kept in --output files, left out of the closing line


def report_config(config) -> dict:
    """`config` (a dict or a dataclass) as a report holds it: a dict, API keys redacted."""
    if dataclasses.is_dataclass(config):
        config = dataclasses.asdict(config)
    return _redact(config)


def make_report(kind: str, config, results: dict, gpu: dict | None = None) -> dict:
    """The report every bench command returns; `config` may be a dataclass."""
    gpu = gpu if gpu is not None else {"available": False, "reason": "not monitored"}
    return {
        "schema": SCHEMA,
        "kind": kind,
        "config": report_config(config),
        "results": results,
        "gpu": gpu,
        "env": env_info(),
    }


def check_report(report: dict) -> None:
    """Raise ValueError naming what is missing or wrong."""
    if report.get("schema") != SCHEMA:
        raise ValueError(f"schema must be {SCHEMA!r}, got {report.get('schema')!r}")
    for key in ("kind", "config", "results", "gpu", "env"):
        if key not in report:
            raise ValueError(f"report lacks {key!r}")
    if not isinstance(report["gpu"].get("available"), bool):
        raise ValueError("report['gpu']['available'] must be a bool")


def env_info() -> dict:
    """Where the figures came from (cheap: no heavy imports)."""
    versions = {}
    for pkg in ("tandem", "torch", "aiohttp", "nvidia-ml-py", "transformers"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "git_commit": _git_commit(),
        "argv": [
            SECRET if a.startswith("--api-key=") or (i and sys.argv[i - 1] == "--api-key") else a
            for i, a in enumerate(sys.argv)
        ],
        "versions": versions,
    }


def _redact(obj):
    """Reports get shared: no API keys in them."""
    if isinstance(obj, dict):
        return {k: (SECRET if k == "api_key" and v else _redact(v)) for k, v in obj.items()}
    return obj


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def compact(obj):
    """`obj` without the bulky per-request and per-sample lists."""
    if isinstance(obj, dict):
        return {k: compact(v) for k, v in obj.items() if k not in BULKY_KEYS}
    if isinstance(obj, list):
        return [compact(v) for v in obj]
    return obj


def _clean(obj):
    """JSON has no inf/nan: write them as strings so the file stays valid JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj


def json_line(report: dict) -> str:
    return json.dumps(_clean(compact(report)), separators=(",", ":"))


def write_json(report: dict, path: str | os.PathLike) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(_clean(report), indent=1) + "\n")


def flatten(d: dict, prefix: str = "") -> dict:
    """{'ttft_ms': {'p99': 3}} -> {'ttft_ms.p99': 3}; lists are left out."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        elif not isinstance(v, list):
            out[key] = v
    return out


def write_csv(rows: list[dict], path: str | os.PathLike) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    columns: list[str] = []
    for row in rows:
        columns += [c for c in row if c not in columns]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def console(stderr: bool = False):
    """A rich console; a fixed width when not a terminal so logs do not wrap tables."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    return Console(file=stream, width=None if stream.isatty() else 160)


def fmt(v, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:,.{digits}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def print_kv(title: str, sections: list[tuple[str, list[tuple[str, object]]]]) -> None:
    """A two-column table in sections, like vLLM's benchmark result block."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=escape(title), show_header=False, title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for i, (section, rows) in enumerate(sections):
        if section:
            table.add_row(f"[bold]{escape(section)}[/bold]", "")
        for name, value in rows:
            table.add_row(escape(name), escape(fmt(value)))
        if i < len(sections) - 1:
            table.add_section()
    console().print(table)


def print_rows(title: str, columns: list[str], rows: list[list[object]]) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=escape(title), title_justify="left")
    for i, c in enumerate(columns):
        table.add_column(escape(c), justify="left" if i == 0 else "right", no_wrap=i == 0)
    for row in rows:
        table.add_row(*[escape(fmt(v)) for v in row])
    console().print(table)


def progress(total: int, description: str, enabled: bool = True):
    """A live progress bar on stderr, silent when stderr is not a terminal."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    bar = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console(stderr=True),
        disable=not (enabled and sys.stderr.isatty()),
        transient=True,
    )
    task = bar.add_task(description, total=total)
    return bar, task


def pyplot():
    """matplotlib's pyplot on the Agg backend: files only, no display needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path) -> None:
    """Write `fig` as a PNG and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)


def plot_timeline(
    path: str,
    timeline: list[tuple[float, int]],
    t_gpu: list[float],
    util: list[list[float | None]],
    t0: float,
    queue: dict | None = None,
) -> None:
    """Requests in flight and each GPU's utilization over the run, on one time axis; with
    `queue` (`QueueSampler.series`: times from t0, running, waiting) where the requests were."""
    plt = pyplot()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(9, 4))
    if timeline:
        ax.step(
            [t - t0 for t, _ in timeline],
            [n for _, n in timeline],
            where="post",
            color="tab:blue",
            label="requests in flight",
        )
    if queue and queue["t"]:
        ax.plot(queue["t"], queue["running"], color="tab:green", lw=1.0, label="running (server)")
        ax.plot(queue["t"], queue["waiting"], color="tab:orange", lw=1.0, label="waiting (server)")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("requests")
    if t_gpu and util:
        ax2 = ax.twinx()
        for k, dev in enumerate(util):
            ax2.plot(
                [t - t0 for t in t_gpu],
                [u if u is not None else float("nan") for u in dev],
                lw=0.8,
                label=f"gpu{k} util",
            )
        ax2.set_ylim(0, 105)
        ax2.set_ylabel("GPU utilization (%)")
        ax2.legend(loc="upper right")
    ax.legend(loc="upper left")
    save_figure(fig, path)


def finish(report: dict, output: str | None, print_json: bool = False) -> int:
    """Write the full report to `output` if asked; `print_json`: end stdout with its one line of
    JSON for machines (STYLE.md §7). Without it stdout keeps the table alone."""
    if output:
        write_json(report, output)
        print(f"report written to {output}", flush=True)
    if print_json:
        print(json_line(report), flush=True)
    return 0


def add_output_args(p, output_help: str = "write the full JSON report here") -> None:
    """--output FILE and --json, the same on every bench command."""
    p.add_argument("--output", default=None, help=output_help)
    p.add_argument("--json", dest="print_json", action="store_true",
                   help="end stdout with the report as one line of JSON (bulky lists left out)")
