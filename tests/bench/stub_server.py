"""A stub OpenAI-compatible server for bench tests, streaming as vLLM does, with a known latency.

Latency model: first token after `ttft_ms`, then one token every `tpot_ms`; with `capacity` set,
both stretch by in_flight / capacity once more than `capacity` requests are in flight, so output
throughput plateaus at capacity / tpot (the knee a sweep must find). It can fail requests: HTTP
500 (`fail_every`), an error event mid-stream (`error_every`), a dropped connection (`drop_every`).

Run alone (for `bench sweep --launch`): python tests/bench/stub_server.py --port P --capacity C
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from dataclasses import dataclass

from aiohttp import web


@dataclass
class StubConfig:
    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    capacity: int | None = None
    fail_every: int = 0  # every k-th request: HTTP 500
    error_every: int = 0  # every k-th request: an error event after half its tokens
    drop_every: int = 0  # every k-th request: connection closed mid-stream
    send_usage: bool = True
    finish_chunk: bool = False  # a separate last chunk with "" text and finish_reason (SGLang)
    split_events: bool = False  # token events split over two writes, with CRLF line ends
    eos_after: int | None = None  # stop early unless ignore_eos (to test short outputs)
    model: str = "stub-model"
    send_done: bool = True  # False: the stream ends at EOF after its finish (transformers serve)
    max_model_len: int | None = None  # listed at /v1/models when set
    reject_fields: tuple[str, ...] = ()  # a 422 naming these fields when a request sends them
    vllm_metrics: bool = False  # /metrics with vLLM's counters: a step a request's prompt, one a token


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class StubServer:
    """Runs in a background thread on 127.0.0.1 with an ephemeral port."""

    def __init__(self, cfg: StubConfig | None = None):
        self.cfg = cfg or StubConfig()
        self.in_flight = 0
        self.max_in_flight = 0
        self.count = 0
        self.tokens_sent = 0
        self.steps = 0
        self.step_tokens = 0
        self.arrivals: list[float] = []  # time.perf_counter() as each generation request came
        self.payloads: list[dict] = []
        self.base_url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        if self.cfg.vllm_metrics:
            app.router.add_get("/metrics", self._metrics)
        return app

    async def _metrics(self, _request):
        model = f'model_name="{self.cfg.model}"'
        lines = [
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{model}}} {float(self.tokens_sent)}",
            "# TYPE vllm:iteration_tokens_total histogram",
            f'vllm:iteration_tokens_total_bucket{{le="+Inf",{model}}} {float(self.steps)}',
            f"vllm:iteration_tokens_total_count{{{model}}} {float(self.steps)}",
            f"vllm:iteration_tokens_total_sum{{{model}}} {float(self.step_tokens)}",
            f"vllm:num_preemptions_total{{{model}}} 0.0",
        ]
        running = min(self.in_flight, self.cfg.capacity or self.in_flight)  # the rest queue
        lines += [f"vllm:num_requests_running{{{model}}} {float(running)}",
                  f"vllm:num_requests_waiting{{{model}}} {float(self.in_flight - running)}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _health(self, _request):
        return web.Response(text="ok")

    async def _models(self, _request):
        card = {"id": self.cfg.model}
        if self.cfg.max_model_len is not None:
            card["max_model_len"] = self.cfg.max_model_len
        return web.json_response({"object": "list", "data": [card]})

    def _scale(self) -> float:
        cap = self.cfg.capacity
        return max(1.0, self.in_flight / cap) if cap else 1.0

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.payloads.append(body)
        self.arrivals.append(time.perf_counter())
        self.count += 1
        k, cfg = self.count, self.cfg
        if cfg.fail_every and k % cfg.fail_every == 0:
            return web.json_response({"error": {"message": "injected failure"}}, status=500)
        rejected = [f for f in cfg.reject_fields if f in body]
        if rejected:
            return web.json_response({"detail": [{"loc": ["body", f], "msg": "Extra inputs are not "
                                                  "permitted"} for f in rejected]}, status=422)
        chat = request.path.endswith("/chat/completions")
        n = int(body.get("max_tokens") or 16)
        if cfg.eos_after and not body.get("ignore_eos"):
            n = min(n, cfg.eos_after)
        prompt = " ".join(m["content"] for m in body["messages"]) if chat else body["prompt"]
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.steps += 1  # the prompt's step
        self.step_tokens += len(prompt.split())
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await asyncio.sleep(cfg.ttft_ms / 1000 * self._scale())
            if chat:
                await resp.write(_event(self._chunk(chat, "", None, role=True)))
            for i in range(n):
                if i > 0:
                    await asyncio.sleep(cfg.tpot_ms / 1000 * self._scale())
                if cfg.error_every and k % cfg.error_every == 0 and i == n // 2:
                    await resp.write(_event({"error": {"message": "injected stream error"}}))
                    break
                if cfg.drop_every and k % cfg.drop_every == 0 and i == n // 2:
                    request.transport.close()  # abrupt: no [DONE], truncated chunked body
                    return resp
                last = i == n - 1 and not cfg.finish_chunk
                event = _event(self._chunk(chat, f" t{i}", "length" if last else None))
                if cfg.split_events:  # CRLF line ends, each event in two TCP writes
                    event = event.replace(b"\n", b"\r\n")
                    await resp.write(event[:9])
                    await asyncio.sleep(0.002)
                    event = event[9:]
                await resp.write(event)
                self.tokens_sent += 1
                self.steps += 1
                self.step_tokens += 1
            if cfg.finish_chunk:
                await resp.write(_event(self._chunk(chat, "", "length")))
            if cfg.send_usage and (body.get("stream_options") or {}).get("include_usage"):
                p = len(prompt.split())
                usage = {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}
                await resp.write(_event({"choices": [], "usage": usage}))
            if cfg.send_done:
                await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            self.in_flight -= 1

    def _chunk(self, chat: bool, text: str, finish: str | None, role: bool = False) -> dict:
        if chat:
            delta = {"role": "assistant", "content": ""} if role else {"content": text}
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            return {"object": "chat.completion.chunk", "model": self.cfg.model, "choices": [choice]}
        choice = {"index": 0, "text": text, "finish_reason": finish}
        return {"object": "text_completion", "model": self.cfg.model, "choices": [choice]}

    def start(self) -> str:
        started = threading.Event()

        async def serve() -> None:
            self._runner = web.AppRunner(self.app(), access_log=None)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", 0).start()
            self.base_url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
            started.set()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(serve())
            self._loop.run_forever()
            self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        if not started.wait(30):
            raise RuntimeError("stub server did not start")
        return self.base_url

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def __enter__(self) -> StubServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ttft-ms", type=float, default=StubConfig.ttft_ms)
    p.add_argument("--tpot-ms", type=float, default=StubConfig.tpot_ms)
    p.add_argument("--capacity", type=int, default=StubConfig.capacity)
    a = p.parse_args()
    server = StubServer(StubConfig(ttft_ms=a.ttft_ms, tpot_ms=a.tpot_ms, capacity=a.capacity))
    web.run_app(server.app(), host="127.0.0.1", port=a.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
