"""What `bench sweep` shows: the console table, latency-versus-load and Pareto plots (PNG,
matplotlib Agg), and a Markdown report naming the sweet spot."""

from __future__ import annotations

from pathlib import Path

from tandem.bench import report as rp


def _series(points: list[dict]) -> dict[str, list[dict]]:
    """Points grouped by launch grid point, each group in increasing load."""
    groups: dict[str, list[dict]] = {}
    for p in points:
        g = p["grid"]
        key = f"seqs={g['max_num_seqs']} tokens={g['max_num_batched_tokens']}" if g else "server"
        groups.setdefault(key, []).append(p)
    for key in groups:
        groups[key].sort(key=lambda p: p["request_throughput"])
    return groups


def _row(i: int, p: dict, spot: int | None) -> list[object]:
    grid = p["grid"]
    where = f"{grid['max_num_seqs']}/{grid['max_num_batched_tokens']} " if grid else ""
    mark = " *" if i == spot else ""
    return [
        where + p["label"] + mark,
        p["request_throughput"],
        p["output_throughput"],
        p["output_tok_s_per_user"],
        p["ttft_ms"]["median"],
        p["ttft_ms"]["p99"],
        p["tpot_ms"]["median"],
        p["tpot_ms"]["p99"],
        p["failed"],
        p["gpu_util_mean"],
        p["meets_slo"],
    ]


def _spread(p: dict) -> list[object]:
    """A point's run count and its output throughput's coefficient of variation, in %."""
    runs = p.get("runs")
    if not runs:
        return [1, None]
    cv = runs["stats"].get("output_throughput", {}).get("cv")
    return [runs["num_runs"], None if cv is None else 100 * cv]


COLUMNS = [
    "load",
    "req/s",
    "out tok/s",
    "tok/s/user",
    "TTFT p50",
    "TTFT p99",
    "TPOT p50",
    "TPOT p99",
    "failed",
    "GPU util %",
    "meets SLO",
]


def print_sweep(report: dict) -> None:
    res = report["results"]
    spot = res["sweet_spot"]
    idx = spot["index"] if spot else None
    rows = [_row(i, p, idx) for i, p in enumerate(res["points"])]
    columns = COLUMNS
    if any(p.get("runs") for p in res["points"]):  # --num-runs: each point a median run
        columns = [*COLUMNS, "runs", "tok/s cv %"]
        rows = [[*row, *_spread(p)] for row, p in zip(rows, res["points"])]
    rp.print_rows("bench sweep (latencies in ms; * = sweet spot)", columns, rows)
    from rich.markup import escape

    out = rp.console()
    out.print(escape(sweet_spot_line(res)))
    for f in res["grid_failures"]:
        out.print(
            f"[red]grid point {escape(str(f['grid']))} failed:[/red] {escape(f['error'][-300:])}"
        )


def sweet_spot_line(res: dict) -> str:
    slo = ", ".join(f"p99 {k} <= {v:g} ms" for k, v in (res["slo_ms"] or {}).items())
    spot = res["sweet_spot"]
    if spot is None:
        return f"sweet spot: none of {len(res['points'])} loads meets the SLO ({slo})"
    grid = f" with {spot['grid']}" if spot["grid"] else ""
    cond = f" meeting {slo}" if slo else " (no SLO given: the highest throughput)"
    return (
        f"sweet spot: {spot['label']}{grid}: {spot['output_throughput']:,.1f} output tok/s, "
        f"p99 TTFT {rp.fmt(spot['ttft_p99_ms'], 1)} ms, p99 TPOT "
        f"{rp.fmt(spot['tpot_p99_ms'], 1)} ms{cond}"
    )


def plot_latency_vs_load(report: dict, path: str | Path) -> None:
    """TTFT and TPOT (median and p99) against the request rate reached, one curve per grid point."""
    plt = rp.pyplot()
    res = report["results"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for (key, title), ax in zip((("ttft", "TTFT"), ("tpot", "TPOT")), axes):
        for name, pts in _series(res["points"]).items():
            x = [p["request_throughput"] for p in pts]
            for stat, style in (("median", "-o"), ("p99", "--x")):
                y = [p[f"{key}_ms"][stat] for p in pts]
                ax.plot(
                    x,
                    [v if v is not None else float("nan") for v in y],
                    style,
                    label=f"{name} {stat}",
                )
        limit = (res["slo_ms"] or {}).get(key)
        if limit:
            ax.axhline(limit, color="red", lw=1, ls=":", label=f"SLO {limit:g} ms")
        ax.set_xlabel("requests/s reached")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(f"{title} against load")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    rp.save_figure(fig, path)


def plot_pareto(report: dict, path: str | Path) -> None:
    """Output tok/s per user against per GPU; the frontier joined, the sweet spot starred."""
    plt = rp.pyplot()
    res = report["results"]
    pts = res["points"]
    fig, ax = plt.subplots(figsize=(7, 5))
    for name, group in _series(pts).items():
        ax.scatter(
            [p["output_tok_s_per_user"] or 0 for p in group],
            [p["output_tok_s_per_gpu"] for p in group],
            label=name,
            s=22,
        )
    front = sorted((pts[i] for i in res["pareto"]), key=lambda p: p["output_tok_s_per_user"])
    ax.plot(
        [p["output_tok_s_per_user"] for p in front],
        [p["output_tok_s_per_gpu"] for p in front],
        "k-",
        lw=1,
        label="Pareto frontier",
    )
    if res["sweet_spot"]:
        s = pts[res["sweet_spot"]["index"]]
        ax.scatter(
            [s["output_tok_s_per_user"] or 0],
            [s["output_tok_s_per_gpu"]],
            marker="*",
            s=220,
            color="gold",
            edgecolor="k",
            zorder=5,
            label="sweet spot",
        )
    ax.set_xlabel("output tokens/s per user (1000 / median TPOT)")
    ax.set_ylabel(f"output tokens/s per GPU ({res['num_gpus']} GPU)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    rp.save_figure(fig, path)


def write_markdown(report: dict, path: str | Path) -> None:
    res, cfg = report["results"], report["config"]
    target, ds = cfg["serve"]["target"], cfg["serve"]["dataset"]
    model = target["model"] or next((p["model"] for p in res["points"]), None)
    prompts = (
        f"random, input {ds['input_len']} / output {ds['output_len']} tokens, range ratio "
        f"{ds['range_ratio']}"
        if ds["dataset_name"] == "random"
        else f"{ds['dataset_name']} `{ds['dataset_path']}`"
    )
    lines = [
        "# bench sweep",
        "",
        f"- target: `{target['base_url']}{target['endpoint']}`, model `{model}`",
        f"- prompts: {prompts}; up to {ds['num_prompts']} requests per load",
        f"- mode: {cfg['mode']}" + (f", launch `{cfg['launch']}`" if cfg["launch"] else ""),
        f"- GPU: {_gpu_line(report['gpu'])}",
        f"- when: {report['env']['time_utc']} on {report['env']['host']}",
        "",
        f"**{sweet_spot_line(res)}**",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + " --- |" * len(COLUMNS),
    ]
    spot = res["sweet_spot"]["index"] if res["sweet_spot"] else None
    for i, p in enumerate(res["points"]):
        lines.append("| " + " | ".join(rp.fmt(v) for v in _row(i, p, spot)) + " |")
    lines += [
        "",
        "Latencies in ms; TPOT excludes the first token; tok/s/user = 1000 / median TPOT.",
        "",
        "![latency against load](latency_vs_load.png)",
        "",
        "![Pareto](pareto.png)",
        "",
    ]
    warnings = {p["client_warning"] for p in res["points"] if p["client_warning"]}
    lines += [f"> warning: {w}" for w in warnings]
    lines += [f"> grid point {f['grid']} failed: {f['error'][-200:]}" for f in res["grid_failures"]]
    Path(path).write_text("\n".join(lines) + "\n")


def _gpu_line(gpu: dict) -> str:
    if not gpu.get("available"):
        return gpu.get("reason") or "no GPU"
    names = sorted({d["name"] for d in gpu["devices"]})
    return f"{len(gpu['devices'])} x {', '.join(names)}"
