"""The CLI contract: subcommands added to a caller's subparsers; defaults read from dataclasses."""

import argparse

from tandem.bench.cli import _serve_config, add_bench_subcommands
from tandem.bench.client_overhead import OverheadConfig
from tandem.bench.interconnect import InterconnectConfig
from tandem.bench.serve import ServeConfig
from tandem.bench.sweep import SweepConfig


def parser():
    p = argparse.ArgumentParser(prog="tandem")
    top = p.add_subparsers(dest="command")
    bench = top.add_parser("bench").add_subparsers(dest="bench_command", required=True)
    add_bench_subcommands(bench)
    bench.add_parser("throughput")  # the caller adds its own commands beside ours
    return p


def test_subcommands_and_funcs():
    p = parser()
    for cmd in ("serve", "sweep", "interconnect", "client-overhead"):
        args = p.parse_args(["bench", cmd])
        assert callable(args.func), cmd


def test_serve_defaults_come_from_the_dataclasses():
    args = parser().parse_args(["bench", "serve"])
    assert _serve_config(args) == ServeConfig()
    args = parser().parse_args(
        [
            "bench",
            "serve",
            "--request-rate",
            "inf",
            "--max-concurrency",
            "64",
            "--random-input-len",
            "512",
            "--slo",
            "ttft=1000",
            "--no-ignore-eos",
            "--endpoint",
            "chat",
        ]
    )
    cfg = _serve_config(args)
    assert cfg.load.max_concurrency == 64 and cfg.dataset.input_len == 512
    assert cfg.slo == "ttft=1000" and not cfg.target.ignore_eos and cfg.target.is_chat


def test_other_defaults():
    args = parser().parse_args(["bench", "sweep"])
    assert (args.mode, args.sweep_size, args.launch) == (
        SweepConfig.mode,
        SweepConfig.sweep_size,
        SweepConfig.launch,
    )
    args = parser().parse_args(["bench", "interconnect", "--backend", "gloo"])
    assert args.world_size == InterconnectConfig.world_size and args.backend == "gloo"
    args = parser().parse_args(["bench", "client-overhead"])
    assert args.num_prompts == OverheadConfig.num_prompts
