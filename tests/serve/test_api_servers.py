"""Several API servers over one engine core (`tandem serve --api-server-count N`).

The core's routing, through real pipes to a real engine-core process: each API server gets its
own outputs and replies, cannot abort another's request, and its hang-up frees only its own
requests. Then the command as users run it: requests served, SIGTERM drains and exits 0, and a
dead API server takes the whole server down (exit 1) rather than leaving a port that half works.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tandem import SamplingParams
from tandem.config import EngineConfig
from tandem.engine.async_llm import AsyncLLM, EngineUnavailable
from tandem.engine.core import ABORT, ADD, STOP, UTILITY, EngineCoreOutputs
from tandem.engine.core_client import EngineCoreProc
from tandem.engine.core_fanout import CoreClients
from tandem.outputs import RequestOutput
from tandem.serve.config import (
    AUTO_API_SERVERS_MAX,
    AUTO_CORES_PER_API_SERVER,
    ServeConfig,
    auto_api_server_count,
)

from .helpers import ServeProcess, held_by_engine

GREEDY = SamplingParams(temperature=0, max_tokens=6)
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
LONGER = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)  # outlives LONG


async def _tokens(llm: AsyncLLM, rid: str, params: SamplingParams = GREEDY) -> list[int]:
    ids: list[int] = []
    async for out in llm.generate(rid, [5, 6, 7, 8], params):
        ids += out.outputs[0].token_ids
    return ids


def _echo(engine, value):  # runs in the engine core
    return value


async def _until(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_two_api_servers_get_only_their_own_outputs_and_a_hang_up_frees_only_its_requests(
    tiny_llama_dir,
):
    core = EngineCoreProc(
        EngineConfig(model=tiny_llama_dir, device="cpu", max_num_seqs=8), num_api_servers=2
    )
    a = AsyncLLM(attach_to=(core.conns[0], core.info))
    b = AsyncLLM(attach_to=(core.conns[1], core.info))

    async def main() -> None:
        # the same request through both: each stream gets its own tokens, and the same ones
        ta, tb = await asyncio.gather(_tokens(a, "x"), _tokens(b, "y"))
        assert ta == tb and len(ta) == GREEDY.max_tokens
        # both count their utility calls from 0: each reply reaches its own caller
        assert await asyncio.gather(a.call(_echo, "a"), b.call(_echo, "b")) == ["a", "b"]

        # b can neither reuse a's request id while it runs, nor abort a's request
        long_a = asyncio.ensure_future(_tokens(a, "shared-id", LONG))
        await _until(lambda: a.stats.num_unfinished == 1)
        with pytest.raises(EngineUnavailable, match="already in flight"):
            await _tokens(b, "shared-id")
        b.abort("shared-id")
        assert len(await long_a) == LONG.max_tokens
        # admission control counts each server's own adds, its refused one too (a: x, shared-id;
        # b: y, shared-id): else every refusal would stay a phantom waiting request
        await _until(lambda: a.stats.num_added == 2 and b.stats.num_added == 2)

        # a hangs up with a request in flight: it fails there, b's request runs on
        cut = asyncio.ensure_future(_tokens(a, "cut", LONGER))
        runs_on = asyncio.ensure_future(_tokens(b, "runs-on", LONG))
        await _until(lambda: b.stats.num_running == 2)
        await asyncio.to_thread(a.shutdown)
        with pytest.raises(EngineUnavailable, match="stopped"):
            await cut
        assert len(await runs_on) == LONG.max_tokens
        assert await b.call(held_by_engine) == (0, 0)  # a's request aborted, its blocks freed
        assert b.is_alive

    try:
        asyncio.run(asyncio.wait_for(main(), 120))  # a request lost by the routing hangs: fail
        b.shutdown()  # the last API server gone: the core stops by itself
        core.proc.join(30)
        assert core.proc.exitcode == 0
    finally:
        a.shutdown(5)
        b.shutdown(5)
        core.shutdown(5)


def test_core_clients_give_each_call_its_own_id_and_answer_a_refusal_at_once():
    """Two servers' utility calls with the same id, pending in the same iteration, each get
    their own reply; an add refused by the router is answered without waiting for a step."""
    pipes = [(mp.Pipe(duplex=False), mp.Pipe(duplex=False)) for _ in range(2)]
    clients = CoreClients([cmd_r for (cmd_r, _), _ in pipes], [out_s for _, (_, out_s) in pipes])
    clients.start()
    to_core = [cmd_s for (_, cmd_s), _ in pipes]
    from_core = [out_r for _, (out_r, _) in pipes]
    to_core[0].send([(UTILITY, 0, "call", ()), (ADD, "r", [1], GREEDY, "delta")])
    to_core[1].send([(UTILITY, 0, "call", ()), (ADD, "r", [1], GREEDY, "delta")])
    time.sleep(0.2)
    cmds = clients.get_commands(block=False)
    core_ids = [cmd[1] for cmd in cmds if cmd[0] == UTILITY]
    assert len(core_ids) == 2 and core_ids[0] != core_ids[1]
    assert [cmd[1] for cmd in cmds if cmd[0] == ADD] == ["r"]  # the second "r" refused
    assert from_core[1].poll(5), "the refusal waits for a step"
    refused = from_core[1].recv()  # sent by get_commands itself: no step was needed
    assert [rid for rid, _ in refused.failed] == ["r"]
    assert "already in flight" in str(refused.failed[0][1])

    replies = [(core_ids[1], "for 1", None), (core_ids[0], "for 0", None)]
    clients.send(EngineCoreOutputs(replies=replies))
    assert from_core[0].recv().replies == [(0, "for 0", None)]
    assert from_core[1].recv().replies == [(0, "for 1", None)]

    done = RequestOutput("r", None, [1], [], finished=True)
    clients.send(EngineCoreOutputs(outputs=[done]))
    assert from_core[0].recv().outputs[0].request_id == "r"
    assert not clients.owner and not clients.calls  # finished and replied: nothing held

    to_core[1].send([(ADD, "s", [1], GREEDY, "delta")])
    to_core[0].send([(STOP,)])
    to_core[1].close()
    time.sleep(0.2)
    cmds = clients.get_commands(block=True)  # both hung up: s is aborted, and the core stops
    assert (ABORT, ["s"]) in cmds and cmds[-1] == (STOP,)
    assert not clients.owner
    clients.close()


def test_several_api_servers_need_the_engine_in_its_own_process():
    with pytest.raises(ValueError, match="api_server_count 2 needs engine_mode 'process'"):
        ServeConfig(api_server_count=2, engine_mode="thread")
    for bad in (0, -1, True, 2.0, "2"):
        with pytest.raises(ValueError, match="api_server_count must be an int >= 1 or None"):
            ServeConfig(api_server_count=bad)


def test_api_server_count_by_default_from_the_device_and_the_host():
    auto = auto_api_server_count
    # several only for a CUDA engine in its own process, without the admin API's one server
    assert auto("cuda", "process", False, cpu_cores=16) == 2
    assert auto("cuda", "process", False, cpu_cores=128) == AUTO_API_SERVERS_MAX
    assert auto("cuda", "process", False, cpu_cores=AUTO_CORES_PER_API_SERVER - 1) == 1
    assert auto("cpu", "process", False, cpu_cores=128) == 1  # the cores are the engine's
    assert auto("cuda", "thread", False, cpu_cores=128) == 1
    assert auto("cuda", "process", True, cpu_cores=128) == 1
    # what is given wins; None asks the host
    assert ServeConfig(api_server_count=3).resolved_api_server_count("cpu") == 3
    assert ServeConfig().resolved_api_server_count("cpu") == 1
    assert ServeConfig(engine_mode="thread").resolved_api_server_count("cuda") == 1
    assert ServeConfig().resolved_api_server_count("cuda", enable_admin_api=True) == 1


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _complete(url: str, prompt: str) -> list[int]:
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "return_token_ids": True}
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Connection": "close"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())["choices"][0]["token_ids"]


@dataclass
class _Served:
    proc: ServeProcess
    url: str
    core: int  # the engine core's pid
    api_servers: list[int]  # the API servers' pids

    def children_alive(self) -> bool:
        return any(map(_alive, [self.core, *self.api_servers]))


@contextlib.contextmanager
def _serve(model_dir: str) -> Iterator[_Served]:
    """A served tiny model with two API servers. The parent is killed if still running at the
    end; its children too, but only when the block failed (else the test checks them)."""
    proc = ServeProcess(
        [model_dir, "--port", "0", "--device", "cpu", "--api-server-count", "2"]
        + ["--shutdown-timeout", "2", "--log-level", "warning"]
    )
    pids = []
    try:
        url = proc.url()
        m = re.search(r"engine core pid (\d+); API server pids (\d+), (\d+)", "".join(proc.lines))
        assert m, "".join(proc.lines)
        pids = [int(m[1]), int(m[2]), int(m[3])]
        yield _Served(proc, url, pids[0], pids[1:])
    except BaseException:
        for pid in filter(_alive, pids):
            os.kill(pid, signal.SIGKILL)
        raise
    finally:
        if proc.p.poll() is None:
            proc.p.kill()


def _scrape(url: str, pattern: re.Pattern) -> int:
    req = urllib.request.Request(url + "/metrics", headers={"Connection": "close"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        m = pattern.search(resp.read().decode())
    return int(m[1]) if m else 0


async def _complete_all(url: str, prompts: list[str]) -> list[list[int]]:
    return await asyncio.gather(*(asyncio.to_thread(_complete, url, p) for p in prompts))


def test_serve_with_two_api_servers_serves_and_stops_on_sigterm(tiny_llama_dir):
    with _serve(tiny_llama_dir) as s:
        results = asyncio.run(_complete_all(s.url, ["Hello there"] * 12))
        assert all(r == results[0] and len(r) == 5 for r in results)
        # whichever server answers the scrape, its request counters cover both: each publishes
        # its own once a second, and when it answers; counters never go back between scrapes
        finished = re.compile(r'request_success_total\{[^}]*finished_reason="length"\} (\d+)')
        seen, deadline = [_scrape(s.url, finished)], time.monotonic() + 30
        while seen[-8:] != [12] * 8:
            assert time.monotonic() < deadline, f"finished requests per scrape: {seen}"
            seen.append(_scrape(s.url, finished))
        assert seen == sorted(seen), f"a counter went back: {seen}"
        s.proc.p.send_signal(signal.SIGTERM)
        assert s.proc.p.wait(timeout=60) == 0, "".join(s.proc.lines)
    assert "tandem serve: stopped" in "".join(s.proc.lines)
    assert not s.children_alive(), "a child process outlived the server"


def test_a_dead_api_server_stops_the_whole_server_with_exit_1(tiny_llama_dir):
    with _serve(tiny_llama_dir) as s:
        assert len(_complete(s.url, "Hi")) == 5
        os.kill(s.api_servers[1], signal.SIGKILL)
        assert s.proc.p.wait(timeout=60) == 1, "".join(s.proc.lines)
    assert "exited (exit code -9); stopping" in "".join(s.proc.lines)
    assert not s.children_alive(), "a child process outlived the server"


def test_a_killed_parent_takes_its_api_servers_and_engine_core_along(
    tiny_llama_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where its metrics directory goes
    with _serve(tiny_llama_dir) as s:
        assert list(tmp_path.glob("tandem-metrics-*"))
        assert len(_complete(s.url, "Hi")) == 5
        s.proc.p.kill()  # SIGKILL: no chance to stop its children itself
        s.proc.p.wait(10)
        deadline = time.monotonic() + 30
        while s.children_alive():
            assert time.monotonic() < deadline, "orphans outlived a killed tandem serve"
            time.sleep(0.1)
    assert not list(tmp_path.glob("tandem-metrics-*")), "the metrics directory leaked"


def test_an_engine_core_dies_with_its_api_server_even_in_a_long_step(tmp_path):
    """An API server SIGKILLed while its engine core is inside a long step (tens of seconds for
    one CPU prefill): the core's pipe says nothing until the step ends; its watch thread does."""
    script = (
        "import subprocess, sys, time\n"
        "core = subprocess.Popen([sys.executable, '-c', 'from tandem.engine.core_proc "
        "import _die_with_the_parent as d; d(0.05); import time; print(flush=True); "
        "time.sleep(600)'], stdout=subprocess.PIPE)\n"
        "core.stdout.readline()\n"
        "print(core.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        core = int(parent.stdout.readline())
        assert _alive(core)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 30
        while _alive(core):
            assert time.monotonic() < deadline, "the engine core outlived its API server"
            time.sleep(0.05)
    finally:
        if parent.poll() is None:
            parent.kill()
