"""`tandem bench serve | sweep | interconnect | client-overhead`: the argparse side.

Defaults come from the config dataclasses (STYLE.md §4). `tandem/cli.py` calls
`add_bench_subcommands(subparsers)`; `python -m tandem.bench.cli serve ...` works alone too.
Every command prints a table for people and ends with one line of JSON for machines.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
from dataclasses import fields, replace

from tandem.bench import report as rp
from tandem.bench import serve as bench_serve
from tandem.bench import sweep as bench_sweep
from tandem.bench.client import TargetConfig
from tandem.bench.client_overhead import OverheadConfig
from tandem.bench.datasets import DATASETS, DatasetConfig
from tandem.bench.interconnect import BACKENDS, InterconnectConfig
from tandem.bench.load import RATE_TYPES, REQUESTS_PER_CLIENT_PROCESS, LoadConfig
from tandem.bench.serve import ServeConfig
from tandem.bench.sweep import MODES, SweepConfig

T, D, L, S, W = TargetConfig, DatasetConfig, LoadConfig, ServeConfig, SweepConfig


def _target_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server under test")
    g.add_argument("--base-url", default=T.base_url, help="server root, e.g. http://127.0.0.1:8000")
    g.add_argument(
        "--endpoint",
        default=T.endpoint,
        help="/v1/completions or /v1/chat/completions (or: completions, chat)",
    )
    g.add_argument("--model", default=T.model, help="model name; default: first of /v1/models")
    g.add_argument("--api-key", default=T.api_key, help="default: $OPENAI_API_KEY")
    g.add_argument("--temperature", type=float, default=T.temperature, help="sampling temperature")
    g.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos/min_tokens (for servers that reject them)",
    )
    g.add_argument("--extra-body", default=T.extra_body, help="JSON merged into every request")
    g.add_argument("--request-timeout-s", type=float, default=T.request_timeout_s,
                   help="a request that takes longer counts as failed")


def _dataset_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prompts")
    g.add_argument("--dataset-name", choices=DATASETS, default=D.dataset_name,
                   help="random tokens, ShareGPT conversations, or a JSONL file of prompts")
    g.add_argument("--dataset-path", default=D.dataset_path, help="ShareGPT JSON or JSONL file")
    g.add_argument("--num-prompts", type=int, default=D.num_prompts, help="requests to send")
    g.add_argument("--input-len", "--random-input-len", type=int, default=D.input_len,
                   help="random: mean prompt tokens")
    g.add_argument("--output-len", "--random-output-len", type=int, default=D.output_len,
                   help="random and jsonl: output tokens, forced with ignore_eos")
    g.add_argument("--range-ratio", "--random-range-ratio", type=float, default=D.range_ratio,
                   help="random: lengths uniform in [L(1-r), L(1+r)]")
    g.add_argument("--sharegpt-output-len", type=int, default=D.sharegpt_output_len,
                   help="sharegpt: output tokens (default: the conversation's reply length)")
    g.add_argument(
        "--tokenizer",
        default=D.tokenizer,
        help="HF tokenizer dir: exact lengths (else random words, approximate)",
    )
    g.add_argument("--seed", type=int, default=D.seed, help="seed of the prompts and arrivals")


def _load_args(p: argparse.ArgumentParser, rate: bool = True) -> None:
    g = p.add_argument_group("load")
    if rate:
        g.add_argument(
            "--request-rate",
            type=float,
            default=L.request_rate,
            help="requests/s; inf (default) sends everything at once",
        )
        g.add_argument("--rate-type", choices=RATE_TYPES, default=L.rate_type,
                       help="arrival process at --request-rate")
    g.add_argument(
        "--burstiness",
        type=float,
        default=L.burstiness,
        help="gamma shape of arrival gaps; 1 = Poisson, < 1 burstier",
    )
    g.add_argument("--max-concurrency", type=int, default=L.max_concurrency,
                   help="most requests in flight at once (default: no bound)")
    g.add_argument(
        "--max-seconds",
        type=float,
        default=L.max_seconds,
        help="stop sending new requests after this long",
    )


def _run_args(p: argparse.ArgumentParser, output_dir: bool = True) -> None:
    g = p.add_argument_group("run")
    g.add_argument("--num-warmups", type=int, default=S.num_warmups,
                   help="requests sent (and discarded) before the measured run")
    g.add_argument(
        "--slo",
        "--goodput",
        default=S.slo,
        help="per-request SLOs in ms, e.g. ttft=1000,tpot=50 (also itl, e2el)",
    )
    g.add_argument(
        "--num-client-processes",
        type=int,
        default=S.num_client_processes,
        help="split the load over this many client processes (default: all at once, one per "
        f"{REQUESTS_PER_CLIENT_PROCESS} requests sent at once, up to a quarter of the cores; else 1)",
    )
    g.add_argument("--no-gpu-monitor", dest="gpu_monitor", action="store_false",
                   help="do not sample the GPUs (NVML) during the run")
    g.add_argument("--gpu-interval-s", type=float, default=S.gpu_interval_s,
                   help="seconds between GPU samples")
    g.add_argument("--gpu-indices", default=S.gpu_indices, help="NVML indices, e.g. 0,1")
    g.add_argument("--no-queue-sampler", dest="queue_sampler", action="store_false",
                   help="do not sample the server's running/waiting gauges at /metrics")
    g.add_argument("--queue-interval-s", type=float, default=S.queue_interval_s,
                   help="seconds between samples of the server's queue gauges")
    g.add_argument("--idle-util-pct", type=float, default=S.idle_util_pct,
                   help="a GPU below this utilization with requests in flight counts as idle")
    g.add_argument(
        "--ceiling-output-tok-s",
        type=float,
        default=S.ceiling_output_tok_s,
        help="roofline output tok/s, to print the fraction reached",
    )
    if output_dir:
        g.add_argument(
            "--output-dir", default=S.output_dir, help="write requests.csv and timeline.png here"
        )
    g.add_argument("--label", default=S.label, help="a name for this run, kept in the report")
    rp.add_output_args(g)


def _build(cls, args: argparse.Namespace, **override):
    kw = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
    kw.update(override)
    return cls(**kw)


def _serve_config(args: argparse.Namespace, **override) -> ServeConfig:
    return _build(
        ServeConfig,
        args,
        target=_build(TargetConfig, args),
        dataset=_build(DatasetConfig, args),
        load=_build(LoadConfig, args),
        **override,
    )


def _fail(kind: str, e: BaseException, print_json: bool = False) -> int:
    msg = f"{type(e).__name__}: {e}"
    if isinstance(e, urllib.error.URLError):
        msg = f"cannot reach the server: {e.reason}"
    print(f"tandem bench {kind}: {msg}", file=sys.stderr)
    if print_json:
        print(json.dumps({"schema": rp.SCHEMA, "kind": kind, "error": msg}), flush=True)
    return 1


def cmd_serve(args: argparse.Namespace) -> int:
    from tandem.bench.client_overhead import STUB_MODEL, instant_stub
    from tandem.bench.serve import print_report
    from tandem.bench.serve_runs import print_runs, run_series

    try:
        cfg = _serve_config(args)
        if args.self_test:
            with instant_stub() as url:
                target = replace(cfg.target, base_url=url, model=STUB_MODEL)
                report = run_series(replace(cfg, target=target))
        else:
            report = run_series(cfg)
    except (ValueError, RuntimeError, OSError) as e:
        return _fail("serve", e, args.print_json)
    print_report(report)
    print_runs(report)
    rp.finish(report, args.output, args.print_json)
    return 1 if report["results"]["completed"] == 0 else 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from tandem.bench.sweep import run_sweep
    from tandem.bench.sweep_report import print_sweep

    try:
        cfg = _build(SweepConfig, args, serve=_serve_config(args, output_dir=None))
        report = run_sweep(cfg)
    except (ValueError, RuntimeError, OSError) as e:
        return _fail("sweep", e, args.print_json)
    print_sweep(report)
    rp.finish(report, args.output, args.print_json)
    return 0 if report["results"]["points"] else 1


def cmd_interconnect(args: argparse.Namespace) -> int:
    from tandem.bench.interconnect import print_interconnect, run_interconnect

    try:
        report = run_interconnect(_build(InterconnectConfig, args))
    except (ValueError, RuntimeError, OSError) as e:
        return _fail("interconnect", e, args.print_json)
    print_interconnect(report)
    rp.finish(report, args.output, args.print_json)
    ar = report["results"]["allreduce"]
    return 1 if ar and not ar["correct"] else 0


def cmd_client_overhead(args: argparse.Namespace) -> int:
    from tandem.bench.client_overhead import print_overhead, run_client_overhead

    try:
        report = run_client_overhead(_build(OverheadConfig, args))
    except (ValueError, RuntimeError, OSError) as e:
        return _fail("client-overhead", e, args.print_json)
    print_overhead(report)
    rp.finish(report, args.output, args.print_json)
    return 0 if report["results"]["failed"] == 0 else 1


def _num_runs_arg(p, help: str) -> None:
    p.add_argument("--num-runs", type=int, default=S.num_runs, help=help)


def add_bench_subcommands(subparsers) -> None:
    """Add serve, sweep, interconnect and client-overhead to a `bench` subparsers object."""
    p = subparsers.add_parser(
        "serve",
        help="online load test of an OpenAI-compatible server",
        description=bench_serve.__doc__,
    )
    _target_args(p)
    _dataset_args(p)
    _load_args(p)
    _run_args(p)
    _num_runs_arg(p, "run the load this many times, each with its own prompts (--seed, --seed + 1, "
                  "...); the report: the median run in full and every run's headline figures")
    p.add_argument(
        "--self-test",
        action="store_true",
        help="load a built-in stub that streams instantly (the client's own cost)",
    )
    p.set_defaults(func=cmd_serve)

    p = subparsers.add_parser(
        "sweep",
        help="loads from one-at-a-time to saturation; sweet spot",
        description=bench_sweep.__doc__,
    )
    _target_args(p)
    _dataset_args(p)
    _load_args(p, rate=False)
    _run_args(p, output_dir=False)
    g = p.add_argument_group("sweep")
    g.add_argument("--mode", choices=MODES, default=W.mode,
                   help="rate: synchronous, saturation, then rates between (GuideLLM's sweep); "
                   "concurrency: a list of fixed concurrencies")
    g.add_argument("--sweep-size", type=int, default=W.sweep_size,
                   help="rate mode: points in all (synchronous + throughput + the rates between)")
    g.add_argument("--sweep-rate-type", choices=RATE_TYPES, default=W.sweep_rate_type,
                   help="rate mode: arrival process of the points between")
    _num_runs_arg(g, "run each point's load this many times, each with its own prompts; a point "
                  "is its median run, with every run's figures and their spread")
    g.add_argument("--sync-prompts", type=int, default=W.sync_prompts,
                   help="rate mode: requests of the synchronous (one-at-a-time) run")
    g.add_argument("--concurrencies", default=W.concurrencies, help="concurrency mode: comma list")
    g.add_argument("--prompts-per-concurrency", type=int, default=W.prompts_per_concurrency,
                   help="concurrency mode: at least c x this requests per point (default: --num-prompts)")
    g.add_argument(
        "--launch",
        default=W.launch,
        help="server command with {max_num_seqs} {max_num_batched_tokens} [{port}], "
        'e.g. "tandem serve M --port {port} --max-num-seqs {max_num_seqs} '
        '--max-num-batched-tokens {max_num_batched_tokens}"',
    )
    g.add_argument("--max-num-seqs", default=W.max_num_seqs, help="launch grid, e.g. 64,128,256")
    g.add_argument("--max-num-batched-tokens", default=W.max_num_batched_tokens,
                   help="launch grid, e.g. 2048,8192")
    g.add_argument("--health-timeout-s", type=float, default=W.health_timeout_s,
                   help="seconds a launched server gets to answer /health")
    g.add_argument("--num-gpus", type=int, default=W.num_gpus,
                   help="the server's GPUs, for tok/s per GPU (default: --gpu-indices' count, or 1)")
    g.add_argument(
        "--output-dir",
        default=W.output_dir,
        help="sweep.json, sweep.csv, report.md, latency_vs_load.png, pareto.png",
    )
    p.set_defaults(func=cmd_sweep)

    IC = InterconnectConfig
    p = subparsers.add_parser("interconnect", help="GPU links, p2p copies, all-reduce bw/latency")
    p.add_argument("--backend", choices=BACKENDS, default=IC.backend,
                   help="auto: nccl with >= 2 GPUs, else say there is no GPU; gloo: on the CPU")
    p.add_argument("--world-size", type=int, default=IC.world_size,
                   help="ranks (default: every GPU with nccl, 2 with gloo)")
    p.add_argument("--min-bytes", default=IC.min_bytes, help="smallest all-reduce (K/M/G suffixes)")
    p.add_argument("--max-bytes", default=IC.max_bytes,
                   help="largest all-reduce (default: 1G with nccl, 16M with gloo)")
    p.add_argument("--iters", type=int, default=IC.iters, help="timed all-reduces per size (5x at <= 1M)")
    p.add_argument("--warmup-iters", type=int, default=IC.warmup_iters, help="untimed ones first")
    p.add_argument("--latency-bytes", default=IC.latency_bytes,
                   help="small messages timed for latency, eager and in a CUDA graph")
    p.add_argument("--graph-ops", type=int, default=IC.graph_ops,
                   help="all-reduces captured in one CUDA graph")
    p.add_argument("--p2p-bytes", default=IC.p2p_bytes, help="size of each GPU-to-GPU copy")
    p.add_argument("--p2p-iters", type=int, default=IC.p2p_iters, help="timed copies per pair")
    rp.add_output_args(p)
    p.set_defaults(func=cmd_interconnect)

    OC = OverheadConfig
    p = subparsers.add_parser(
        "client-overhead", help="the load generator's own ceiling and latency floor"
    )
    p.add_argument("--num-prompts", type=int, default=OC.num_prompts, help="requests to send")
    p.add_argument("--input-len", type=int, default=OC.input_len, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=OC.output_len, help="streamed tokens per request")
    p.add_argument("--max-concurrency", type=int, default=OC.max_concurrency,
                   help="most requests in flight")
    p.add_argument("--num-client-processes", type=int, default=OC.num_client_processes,
                   help="split the load over this many client processes")
    p.add_argument("--endpoint", default=OC.endpoint, help="/v1/completions or /v1/chat/completions")
    rp.add_output_args(p)
    p.set_defaults(func=cmd_client_overhead)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tandem.bench.cli", description="tandem bench (standalone)"
    )
    sub = parser.add_subparsers(dest="bench_command", required=True)
    add_bench_subcommands(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
