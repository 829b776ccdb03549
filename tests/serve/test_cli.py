"""`tandem serve` as a user runs it: a subprocess, flags, an ephemeral port, and SIGTERM."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import signal

import aiohttp

from tandem.cli import build_parser
from tandem.config import EngineConfig

from .helpers import ServeProcess

KEY = "sk-cli"


def test_serve_flags_take_engine_defaults():
    args = build_parser().parse_args(["serve", "some/model", "--max-num-seqs", "3"])
    assert (args.model_arg, args.max_num_seqs, args.host, args.port) == (
        "some/model",
        3,
        "127.0.0.1",
        8000,
    )
    for f in dataclasses.fields(EngineConfig):
        if f.name not in ("model", "max_num_seqs"):
            assert getattr(args, f.name) == f.default, f.name
    assert args.func.__module__ == "tandem.serve.cli"


async def _read(session: aiohttp.ClientSession, url: str, body: dict, first: asyncio.Event) -> str:
    text = ""
    try:
        async with session.post(url, json={**body, "stream": True}) as resp:
            assert resp.status == 200, await resp.text()
            async for chunk in resp.content.iter_any():
                text += chunk.decode()
                first.set()
    except aiohttp.ClientError:
        pass  # cut off by the shutdown
    first.set()
    return text


def test_sigterm_finishes_in_flight_fails_the_rest_cleanly_and_exits_0(tiny_llama_dir):
    proc = ServeProcess(
        [
            tiny_llama_dir,
            "--port",
            "0",
            "--device",
            "cpu",
            "--api-key",
            KEY,
            "--served-model-name",
            "tiny",
            "--max-num-seqs",
            "1",
            "--shutdown-timeout",
            "2",
        ]
    )
    try:
        base = proc.url()
        short = {"model": "tiny", "prompt": "Hello", "max_tokens": 60, "ignore_eos": True}
        long = {"prompt": "Hi", "max_tokens": 480, "ignore_eos": True, "n": 32}

        async def main() -> tuple[str, str]:
            headers = {"Authorization": f"Bearer {KEY}"}
            async with aiohttp.ClientSession(headers=headers) as s:
                started = asyncio.Event()
                a = asyncio.create_task(_read(s, base + "/v1/completions", short, started))
                await started.wait()
                b = asyncio.create_task(_read(s, base + "/v1/completions", long, asyncio.Event()))
                waiting = re.compile(r"num_requests_waiting\{[^}]*\} 1\n")
                while not waiting.search(await (await s.get(base + "/metrics")).text()):
                    await asyncio.sleep(0.01)  # until b waits behind a (one sequence at a time)
                proc.p.send_signal(signal.SIGTERM)
                return await a, await b

        done, cut = asyncio.run(main())
        assert proc.p.wait(timeout=30) == 0, "".join(proc.lines)
    finally:
        if proc.p.poll() is None:
            proc.p.kill()
    assert done.endswith("data: [DONE]\n\n") and done.count('"finish_reason":"length"') == 1
    # still running when the grace period ended: failed with an error event, then [DONE]
    assert cut.endswith('"code":null}}\n\ndata: [DONE]\n\n'), cut[-300:]
    assert "shutting down" in cut
    log = "".join(proc.lines)
    assert "tandem serve: stopped" in log and "Traceback" not in log, log


def _engine_core(pid: int) -> int:
    """The engine core among `pid`'s children (beside multiprocessing's resource tracker)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(p) for p in f.read().split()]
    cores = []
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                cores.append(child)
    assert len(cores) == 1, (children, cores)
    return cores[0]


def test_a_dead_engine_fails_in_flight_requests_and_the_server_exits_1(tiny_llama_dir):
    """So that a supervisor restarts it, instead of a server answering 503 forever."""
    proc = ServeProcess([tiny_llama_dir, "--port", "0", "--device", "cpu", "--max-num-seqs", "1"])
    try:
        base = proc.url()
        body = {"prompt": "Hi", "max_tokens": 480, "ignore_eos": True, "n": 4}

        async def main() -> str:
            async with aiohttp.ClientSession() as s:
                started = asyncio.Event()
                task = asyncio.create_task(_read(s, base + "/v1/completions", body, started))
                await started.wait()
                os.kill(_engine_core(proc.p.pid), signal.SIGKILL)
                return await task

        text = asyncio.run(main())
        assert proc.p.wait(timeout=60) == 1, "".join(proc.lines)
    finally:
        if proc.p.poll() is None:
            proc.p.kill()
    assert text.endswith("data: [DONE]\n\n") and "died" in text, text[-300:]
    assert "exiting 1" in "".join(proc.lines)
