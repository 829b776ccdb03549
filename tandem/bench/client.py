"""Async streaming OpenAI client (aiohttp) that timestamps every streamed chunk of every request.

Speaks the format vLLM serves: `data: {json}\\n\\n` events, `data: [DONE]` at the end, usage in a
final chunk with empty `choices` when `stream_options.include_usage` is set. A stream that ends
without `[DONE]` after its choice finished (`transformers serve`) is complete too, as the openai
SDK and vLLM's benchmark client take it.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from tandem.bench.datasets import RequestSpec
from tandem.bench.metrics import RequestRecord

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class TargetConfig:
    """The server under test and what every request asks of it."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"  # or /v1/chat/completions (also: completions | chat)
    model: str | None = None  # None: the first model the server lists at /v1/models
    api_key: str | None = None  # None: $OPENAI_API_KEY if set
    temperature: float = 0.0
    ignore_eos: bool = True  # with min_tokens = max_tokens: forces the output length
    extra_body: str | None = None  # JSON object merged into every request body
    request_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/").removesuffix("/v1")
        self.endpoint = ENDPOINTS.get(self.endpoint, self.endpoint)
        if not self.endpoint.startswith("/"):
            raise ValueError(f"endpoint must be a path like /v1/completions, got {self.endpoint!r}")
        if self.extra_body and not isinstance(json.loads(self.extra_body), dict):
            raise ValueError(f"extra_body must be a JSON object, got {self.extra_body!r}")

    @property
    def is_chat(self) -> bool:
        return "chat" in self.endpoint

    def headers(self) -> dict[str, str]:
        key = self.api_key or os.environ.get("OPENAI_API_KEY")
        h = {"Content-Type": "application/json"}
        if key:
            h["Authorization"] = f"Bearer {key}"
        return h


def raise_fd_limit(needed: int) -> None:
    """Every request in flight holds a socket: lift the soft open-files limit (1024 on many
    hosts) toward the hard one, as vLLM's bench does, instead of failing at high concurrency."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed + 256 if hard == resource.RLIM_INFINITY else min(hard, needed + 256)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def list_models(target: TargetConfig, timeout_s: float = 30.0) -> list[dict]:
    """The model cards of /v1/models."""
    req = urllib.request.Request(target.base_url + "/v1/models", headers=target.headers())
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.load(resp).get("data") or []


def resolve_model(target: TargetConfig, timeout_s: float = 30.0) -> str:
    """The model to ask for: the configured one, else the first listed at /v1/models."""
    if target.model:
        return target.model
    models = list_models(target, timeout_s)
    if not models:
        raise RuntimeError(f"{target.base_url}/v1/models lists no models; pass --model")
    return models[0]["id"]


def max_model_len(target: TargetConfig, model: str) -> int | None:
    """The context length /v1/models gives for `model` (vLLM's and tandem's `max_model_len`
    field), or None where the server does not say."""
    try:
        models = list_models(target)
    except (OSError, ValueError):
        return None
    for card in models:
        if card.get("id") == model and isinstance(card.get("max_model_len"), int):
            return card["max_model_len"]
    return None


def build_payload(spec: RequestSpec, target: TargetConfig, model: str) -> bytes:
    body: dict = {
        "model": model,
        "max_tokens": spec.output_len,
        "temperature": target.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.is_chat:
        body["messages"] = [{"role": "user", "content": spec.prompt}]
        body["max_completion_tokens"] = spec.output_len
    else:
        body["prompt"] = spec.prompt
    if target.ignore_eos:
        body["ignore_eos"] = True
        body["min_tokens"] = spec.output_len
    if target.extra_body:
        body.update(json.loads(target.extra_body))
    return json.dumps(body).encode()


def _is_token(choice: dict, chat: bool) -> bool:
    """Whether a streamed choice carries a token. An empty text still counts (a token that ends
    mid-character decodes to ''), except the chat role header and a bare finish marker."""
    if chat:
        delta = choice.get("delta") or {}
        text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
        if text or delta.get("tool_calls"):
            return True
        return "content" in delta and "role" not in delta and not choice.get("finish_reason")
    text = choice.get("text")
    return text is not None and (text != "" or not choice.get("finish_reason"))


def consume_event(rec: RequestRecord, event: bytes, now: float, chat: bool) -> bool:
    """Apply one SSE event to `rec`; True once the stream has said [DONE]."""
    for line in event.split(b"\n"):
        if not line.startswith(b"data:"):
            continue  # comments (':'), event names, retry hints
        data = line[5:].strip()
        if data == b"[DONE]":
            return True
        obj = json.loads(data)
        if obj.get("error") or obj.get("object") == "error":
            err = obj.get("error", obj)
            msg = err.get("message", err) if isinstance(err, dict) else err
            rec.error = f"stream error: {msg}"[:200]
            continue
        choices = obj.get("choices")
        if choices and _is_token(choices[0], chat):
            rec.token_times.append(now)
        if choices and any(c.get("finish_reason") for c in choices):
            rec.finished = True
        usage = obj.get("usage")
        if usage:
            rec.usage_prompt_tokens = usage.get("prompt_tokens", rec.usage_prompt_tokens)
            rec.usage_completion_tokens = usage.get("completion_tokens")
    return False


async def stream_one(
    session: aiohttp.ClientSession, url: str, body: bytes, rec: RequestRecord, chat: bool
) -> None:
    """Send one request and record the arrival time of every chunk into `rec`."""
    done = False
    rec.t_start = time.perf_counter()
    try:
        async with session.post(url, data=body) as resp:
            rec.t_response = time.perf_counter()
            if resp.status != 200:
                text = (await resp.text())[:200].replace("\n", " ")
                rec.error = f"HTTP {resp.status}: {text}"
                return
            buf = b""
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                buf += data.replace(b"\r\n", b"\n") if b"\r" in data else data
                if b"\n\n" not in buf:
                    continue  # an event split across reads: wait for its end
                *events, buf = buf.split(b"\n\n")  # every event in this read shares `now`
                for event in events:
                    done = consume_event(rec, event, now, chat) or done
            if buf.strip():
                done = consume_event(rec, buf, time.perf_counter(), chat) or done
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError, OSError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:200] or type(e).__name__
    finally:
        rec.t_end = time.perf_counter()
    if not rec.error and not done and not rec.finished:
        rec.error = "stream ended without [DONE] or a finish_reason"
    if not rec.error and not rec.token_times:
        rec.error = "no tokens streamed"
    rec.ok = not rec.error


async def run_requests(
    target: TargetConfig,
    bodies: list[bytes],
    records: list[RequestRecord],
    offsets: list[float],
    max_concurrency: int | None = None,
    t0: float | None = None,
    max_seconds: float | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send `bodies[i]` at `t0 + offsets[i]` (capped at `max_concurrency` in flight). Returns
    the records of the requests sent (all, unless `max_seconds` cut the run short) and t0."""
    url = target.base_url + target.endpoint
    raise_fd_limit(min(len(bodies), max_concurrency or len(bodies)))
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    timeout = aiohttp.ClientTimeout(total=target.request_timeout_s, sock_connect=30)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    sent: list[RequestRecord] = []

    async def one(body: bytes, rec: RequestRecord) -> None:
        rec.t_dispatched = time.perf_counter()
        if sem is not None:
            await sem.acquire()
        try:
            if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
                return
            sent.append(rec)
            await stream_one(session, url, body, rec, target.is_chat)
            if on_done is not None:
                on_done(rec)
        finally:
            if sem is not None:
                sem.release()

    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=target.headers()
    ) as session:
        t0 = time.perf_counter() if t0 is None else t0
        tasks = []
        for body, rec, off in zip(bodies, records, offsets):
            if max_seconds is not None and off > max_seconds:
                break
            delay = t0 + off - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            rec.t_scheduled = t0 + off
            tasks.append(asyncio.create_task(one(body, rec)))
            # let it start now: without this yield a burst's requests all ran aiohttp's set-up
            # before any of them connected and sent (the first of one process's 256 reached the
            # engine 77-81 ms in on one H200 host, 5.7 ms there with it; docs/serving.md)
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
    return sorted(sent, key=lambda r: r.index), t0
