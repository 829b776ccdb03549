"""Test helpers: a real server on a background thread (uvicorn, 127.0.0.1, an ephemeral port) and
an HTTP client for it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import tandem
from tandem.config import EngineConfig
from tandem.engine.async_llm import AsyncLLM
from tandem.serve.app import build_app
from tandem.serve.config import ServeConfig
from tandem.serve.server import bind_socket, make_server

ROOT = Path(tandem.__file__).resolve().parent.parent
MODEL_NAME = "tiny-llama"
ADMIN_KEY = "sk-admin-key"


@dataclass
class Server:
    url: str
    llm: AsyncLLM
    api_key: str | None = None

    def call(self, fn, *args):
        """`fn(engine, *args)` in the engine core (a module-level fn: it may cross processes)."""
        return asyncio.run(self.llm.call(fn, *args))

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def post(self, path: str, body, headers: dict | None = None, timeout: float = 60.0):
        """(status, headers, parsed JSON or raw text) of a POST; `body` dict or raw bytes."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return self.request("POST", path, data, headers, timeout)

    def get(self, path: str, headers: dict | None = None, timeout: float = 30.0):
        return self.request("GET", path, None, headers, timeout)

    def request(
        self, method: str, path: str, data: bytes | None, headers: dict | None, timeout: float
    ):
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers=self.headers() if headers is None else headers,
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.headers, _parse(resp.read(), resp.headers)
        except urllib.error.HTTPError as e:
            return e.code, e.headers, _parse(e.read(), e.headers)

    def stream(self, path: str, body: dict, timeout: float = 60.0) -> list[dict]:
        """The JSON events of a streamed request; asserts the stream ends with [DONE]."""
        status, _, text = self.post(path, {**body, "stream": True}, timeout=timeout)
        assert status == 200, text
        return parse_sse(text)

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Until the engine holds no request and every KV block is free (or fail), as the
        engine itself sees it, not the stats snapshot."""
        deadline = time.monotonic() + timeout
        while (held := self.call(held_by_engine)) != (0, 0):
            assert time.monotonic() < deadline, (
                f"engine not idle: {held[0]} requests, {held[1]} blocks held"
            )
            time.sleep(0.02)


def held_by_engine(engine) -> tuple[int, int]:
    """(requests, KV blocks) the engine holds."""
    bm = engine.block_manager
    return engine.get_num_unfinished_requests(), bm.num_blocks - bm.num_free_blocks


def parse_sse(text: str) -> list[dict]:
    assert text.endswith("data: [DONE]\n\n"), text[-300:]
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events[:3]
    return [json.loads(e[6:]) for e in events[:-1]]


def _parse(raw: bytes, headers):
    text = raw.decode()
    if "application/json" in headers.get("content-type", ""):
        return json.loads(text)
    return text


@contextlib.contextmanager
def run_server(
    model_dir: str,
    app_kwargs: dict | None = None,
    engine_mode: str = ServeConfig.engine_mode,
    server_kwargs: dict | None = None,
    **engine_kwargs,
) -> Iterator[Server]:
    """A server on a background thread (its own event loop), its engine in `engine_mode` (the
    default of `tandem serve`); stopped and joined on exit. `server_kwargs` go to make_server."""
    waiting = engine_kwargs.pop("max_waiting_requests", None)
    config = EngineConfig.from_kwargs(
        **{"model": model_dir, "device": "cpu", "max_num_seqs": 64, **engine_kwargs}
    )
    llm = AsyncLLM.from_config(config, max_waiting_requests=waiting, engine_mode=engine_mode)
    app = build_app(llm, MODEL_NAME, **(app_kwargs or {}))
    try:
        with serve_app(app, llm, (app_kwargs or {}).get("api_key"), **(server_kwargs or {})) as server:
            yield server
    finally:
        llm.shutdown()


@contextlib.contextmanager
def serve_app(app, llm: AsyncLLM, api_key: str | None = None, **server_kwargs) -> Iterator[Server]:
    """`app` served on a background thread (its own event loop) at an ephemeral port of
    127.0.0.1; stopped and joined on exit (the engine is the caller's)."""
    sock = bind_socket("127.0.0.1", 0)
    server = make_server(app, **{"shutdown_timeout_s": 5.0, "log_level": "warning", **server_kwargs})
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "the server thread died while starting"
            time.sleep(0.01)
        yield Server(f"http://127.0.0.1:{sock.getsockname()[1]}", llm, api_key)
    finally:
        server.should_exit = True
        thread.join(15)


class ServeProcess:
    """A `tandem serve` subprocess whose output is drained by a thread (so it never blocks)."""

    def __init__(self, argv: list[str]):
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        self.p = subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", "serve", *argv],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.p.stdout), daemon=True).start()

    def url(self, timeout: float = 90.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if m := re.search(r"listening on (http://\S+)", line):
                    return m.group(1)
            assert self.p.poll() is None, "".join(self.lines)
            time.sleep(0.05)
        raise AssertionError("no 'listening on' line:\n" + "".join(self.lines))
