"""`tandem bench client-overhead`: what the load generator itself costs.

Runs `bench serve` against a stub OpenAI server (started by this command, in its own process so
its CPU is not charged to the client) that streams every token instantly. The throughput reached
is the client's ceiling; TTFT and ITL are the floor the client and loopback add to any figure.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

STUB_MODEL = "tandem-stub"
FLOOR_PROMPTS = 50  # requests sent one at a time for the latency floor


def _chunk(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _instant_app():
    from aiohttp import web

    async def health(_request):
        return web.Response(text="ok")

    async def models(_request):
        return web.json_response({"object": "list", "data": [{"id": STUB_MODEL}]})

    async def generate(request):
        body = await request.json()
        chat = request.path.endswith("/chat/completions")
        n = max(1, int(body.get("max_tokens") or 16))
        if chat:
            prompt = " ".join(m.get("content", "") for m in body.get("messages", []))
            token = _chunk(
                {
                    "object": "chat.completion.chunk",
                    "model": STUB_MODEL,
                    "choices": [{"index": 0, "delta": {"content": " tok"}}],
                }
            )
        else:
            prompt = str(body.get("prompt", ""))
            token = _chunk(
                {
                    "object": "text_completion",
                    "model": STUB_MODEL,
                    "choices": [{"index": 0, "text": " tok", "finish_reason": None}],
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(n):
            await resp.write(token)
        usage = {
            "prompt_tokens": len(prompt.split()),
            "completion_tokens": n,
            "total_tokens": len(prompt.split()) + n,
        }
        await resp.write(_chunk({"choices": [], "usage": usage}) + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    return app


def _serve_forever(conn) -> None:
    from aiohttp import web

    async def main() -> None:
        runner = web.AppRunner(_instant_app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)  # ephemeral port: no collisions
        await site.start()
        conn.send(runner.addresses[0][1])
        await asyncio.Event().wait()

    asyncio.run(main())


@contextmanager
def instant_stub(start_timeout_s: float = 60.0) -> Iterator[str]:
    """Start the instant-streaming stub in a child process; yields its base URL."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve_forever, args=(child,), daemon=True)
    proc.start()
    try:
        if not parent.poll(start_timeout_s):
            raise RuntimeError("the stub server did not start")
        yield f"http://127.0.0.1:{parent.recv()}"
    finally:
        proc.terminate()
        proc.join(5)


@dataclass
class OverheadConfig:
    """The load to push through the client against the instant stub."""

    num_prompts: int = 2000
    input_len: int = 32
    output_len: int = 64
    max_concurrency: int = 256
    num_client_processes: int = 1
    endpoint: str = "/v1/completions"

    def __post_init__(self) -> None:
        if min(self.num_prompts, self.input_len, self.output_len, self.max_concurrency) < 1:
            raise ValueError("num_prompts, input_len, output_len and max_concurrency must be >= 1")


def run_client_overhead(cfg: OverheadConfig, show_progress: bool = True) -> dict:
    """Report (kind 'client-overhead'): the client's ceiling in tok/s and CPU per token under
    load, and the latency floor it adds, measured one request at a time."""
    from tandem.bench import report as rp
    from tandem.bench.client import TargetConfig
    from tandem.bench.datasets import DatasetConfig
    from tandem.bench.load import LoadConfig
    from tandem.bench.serve import ServeConfig, run_benchmark

    with instant_stub() as url:
        base = ServeConfig(
            target=TargetConfig(base_url=url, endpoint=cfg.endpoint, model=STUB_MODEL),
            dataset=DatasetConfig(
                num_prompts=cfg.num_prompts, input_len=cfg.input_len, output_len=cfg.output_len
            ),
            load=LoadConfig(max_concurrency=cfg.max_concurrency),
            num_client_processes=cfg.num_client_processes,
            label="client overhead: ceiling",
        )
        loaded = run_benchmark(base, show_progress)
        floor_prompts = min(cfg.num_prompts, FLOOR_PROMPTS)
        alone = replace(
            base,
            dataset=replace(base.dataset, num_prompts=floor_prompts),
            load=LoadConfig(max_concurrency=1),
            num_client_processes=1,
            label="client overhead: floor",
        )
        floor = run_benchmark(alone, show_progress)["results"]
    res, cl = loaded["results"], loaded["results"]["client"]
    tokens = max(1, res["total_output_tokens"])
    results = {
        "client_ceiling_output_tok_s": res["output_throughput"],
        "client_ceiling_req_s": res["request_throughput"],
        "client_cpu_util_max_process": cl["cpu_util_max_process"],
        "client_cpu_us_per_token": cl["cpu_s"] / tokens * 1e6,
        # tok/s with one core spent on the client alone: the ceiling even when the stub, not
        # the client, limited the loaded run (CPU busy well below 1.0)
        "client_ceiling_one_core_tok_s": tokens / cl["cpu_s"] if cl["cpu_s"] > 0 else None,
        "ttft_floor_ms": floor["ttft_ms"],
        "itl_floor_ms": floor["itl_ms"],
        "e2el_floor_ms": floor["e2el_ms"],
        "ttft_under_load_ms": res["ttft_ms"],
        "completed": res["completed"] + floor["completed"],
        "failed": res["failed"] + floor["failed"],
        "errors": res["errors"] + floor["errors"],
    }
    return rp.make_report("client-overhead", cfg, results, loaded["gpu"])


def print_overhead(report: dict) -> None:
    from tandem.bench import report as rp

    r = report["results"]
    ceiling = [
        ("output tokens/s reached", r["client_ceiling_output_tok_s"]),
        ("requests/s reached", r["client_ceiling_req_s"]),
        ("CPU busy (of one core, busiest process)", r["client_cpu_util_max_process"]),
        ("client CPU per streamed token (us)", r["client_cpu_us_per_token"]),
        ("output tokens/s per fully busy client core", r["client_ceiling_one_core_tok_s"]),
        ("TTFT median under this load (ms)", r["ttft_under_load_ms"]["median"]),
    ]
    floor = [
        ("TTFT median / p99", _pair(r["ttft_floor_ms"])),
        ("ITL median / p99", _pair(r["itl_floor_ms"])),
        ("E2E median / p99", _pair(r["e2el_floor_ms"])),
    ]
    rp.print_kv(
        "bench client-overhead (client against an instant stub)",
        [
            (f"Ceiling ({report['config']['max_concurrency']} in flight)", ceiling),
            ("Floor, one request at a time (ms)", floor),
            ("Requests", [("completed", r["completed"]), ("failed", r["failed"])]),
        ],
    )
    top = r["client_ceiling_one_core_tok_s"] or r["client_ceiling_output_tok_s"]
    rp.console().print(
        f"A server streaming well below {top:,.0f} tok/s per client process is measured "
        "faithfully; above about half of that, add --num-client-processes."
    )


def _pair(d: dict) -> str:
    from tandem.bench.report import fmt

    return f"{fmt(d['median'], 3)} / {fmt(d['p99'], 3)}"
