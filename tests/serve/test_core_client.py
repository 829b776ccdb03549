"""The engine core behind the server: its process dies and the server says so (no hang), a
start-up error crosses as itself, and the in-process thread mode still serves."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tandem.config import EngineConfig
from tandem.engine.async_llm import AsyncLLM
from tandem.engine.llm_engine import LLMEngine

from .helpers import parse_sse, run_server


def test_a_killed_engine_process_fails_requests_clearly_and_health_turns_503(tiny_llama_dir):
    with run_server(tiny_llama_dir) as srv:
        assert srv.get("/health")[0] == 200
        body = {"prompt": "Hello", "max_tokens": 480, "ignore_eos": True}
        results: dict[str, tuple] = {}
        streamed = threading.Thread(
            target=lambda: results.setdefault(
                "stream", srv.post("/v1/completions", {**body, "stream": True}, timeout=30)
            )
        )
        whole = threading.Thread(
            target=lambda: results.setdefault(
                "whole", srv.post("/v1/completions", body, timeout=30)
            )
        )
        streamed.start()
        whole.start()
        while srv.llm.stats.num_unfinished < 2:
            time.sleep(0.005)
        os.kill(srv.llm.engine_core.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        streamed.join(30)
        whole.join(30)
        assert time.monotonic() - t0 < 10, "the requests hung on a dead engine"

        status, _, text = results["stream"]  # headers were out: the error comes as an event
        assert status == 200
        error = parse_sse(text)[-1]["error"]
        assert "engine process died" in error["message"] and "exit code -9" in error["message"]
        status, _, resp = results["whole"]
        assert status == 503 and "engine process died" in resp["error"]["message"], resp

        assert srv.get("/health")[0] == 503
        t0 = time.monotonic()
        status, _, resp = srv.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert status == 503 and resp["error"]["code"] == "engine_unavailable", resp
        assert time.monotonic() - t0 < 5


def test_a_start_up_error_in_the_engine_process_is_raised_as_itself(tmp_path):
    config = EngineConfig(model=str(tmp_path / "no-such-model"), device="cpu")
    with pytest.raises(ValueError) as in_process:
        LLMEngine(config)
    with pytest.raises(ValueError) as across:
        AsyncLLM(config, engine_mode="process")
    assert str(across.value) == str(in_process.value)


def test_thread_mode_serves_streams_and_frees_aborted_requests(tiny_llama_dir):
    with run_server(tiny_llama_dir, engine_mode="thread") as srv:
        body = {"prompt": "Hello", "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        status, _, whole = srv.post("/v1/completions", body)
        events = srv.stream("/v1/completions", body)
        assert status == 200
        assert [t for e in events for t in e["choices"][0]["token_ids"]] == whole["choices"][0][
            "token_ids"
        ]
        srv.wait_idle()
