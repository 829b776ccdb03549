"""Many connections, one continuous batch; disconnects abort; admission control answers 503."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import aiohttp

from tandem import SamplingParams

from .helpers import parse_sse, run_server

WORDS = ["Hello", "The capital", "What is 2", "Once upon a time", "one two three", "my name is"]


async def _stream(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, str]:
    async with session.post(url, json={**body, "stream": True}) as resp:
        return resp.status, await resp.text()


def test_64_concurrent_streams_share_the_batch(server, offline):
    prompts = [f"{WORDS[i % len(WORDS)]} {i}" for i in range(64)]
    lengths = [8 + i % 17 for i in range(64)]
    want = offline.generate(
        prompts, [SamplingParams(temperature=0, max_tokens=n) for n in lengths], use_tqdm=False
    )
    max_running = 0

    async def watch(stop: asyncio.Event) -> None:
        nonlocal max_running
        while not stop.is_set():
            max_running = max(max_running, server.llm.stats.num_running)
            await asyncio.sleep(0.002)

    async def main() -> list[tuple[int, str]]:
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch(stop))
        async with aiohttp.ClientSession() as s:
            results = await asyncio.gather(
                *[
                    _stream(
                        s,
                        server.url + "/v1/completions",
                        {"prompt": p, "max_tokens": n, "temperature": 0, "return_token_ids": True},
                    )
                    for p, n in zip(prompts, lengths)
                ]
            )
        stop.set()
        await watcher
        return results

    results = asyncio.run(main())
    for (status, text), w in zip(results, want):
        assert status == 200, text
        events = parse_sse(text)
        assert [t for e in events for t in e["choices"][0]["token_ids"]] == w.outputs[0].token_ids
        assert "".join(e["choices"][0]["text"] for e in events) == w.outputs[0].text
    assert max_running > 8, f"requests did not share the batch (at most {max_running} ran at once)"
    server.wait_idle()


def _generated(engine) -> int:
    return engine.num_generated_tokens


def _hold(engine, seconds: float) -> None:
    time.sleep(seconds)  # as a long step would


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    before = server.call(_generated)
    body = {"prompt": "Hello", "max_tokens": 480, "ignore_eos": True, "n": 4, "stream": True}

    async def main() -> int:
        async with (
            aiohttp.ClientSession() as s,
            s.post(server.url + "/v1/completions", json=body) as resp,
        ):
            assert resp.status == 200
            chunks = 0
            async for _ in resp.content.iter_any():
                chunks += 1
                if chunks == 3:
                    break  # leaving the block closes the connection mid-stream
            return chunks

    assert asyncio.run(main()) == 3
    server.wait_idle(timeout=10)
    assert server.call(_generated) - before < 4 * 480 / 2, "the request ran on"


def test_disconnect_while_waiting_for_a_full_response_aborts(server):
    before = server.call(_generated)
    body = json.dumps({"prompt": "Hello", "max_tokens": 480, "ignore_eos": True, "n": 4}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        deadline = time.monotonic() + 10
        while not server.llm.stats.num_unfinished:
            assert time.monotonic() < deadline
            time.sleep(0.005)
    server.wait_idle(timeout=10)
    assert server.call(_generated) - before < 4 * 480 / 2, "the request ran on"


def test_admission_control_503_with_retry_after(tiny_llama_dir):
    with run_server(tiny_llama_dir, max_num_seqs=2, max_waiting_requests=3) as srv:

        async def main() -> list[tuple[int, str, str | None]]:
            # Hold the engine thread (as a long step would) while a burst arrives, so requests
            # pile up: three may wait, the rest are turned away at once.
            held = asyncio.create_task(srv.llm.call(_hold, 1.5))
            await asyncio.sleep(0.05)
            async with aiohttp.ClientSession() as s:

                async def one(i: int) -> tuple[int, str, str | None]:
                    async with s.post(
                        srv.url + "/v1/completions", json={"prompt": f"Hello {i}", "max_tokens": 8}
                    ) as r:
                        return r.status, await r.text(), r.headers.get("Retry-After")

                results = await asyncio.gather(*[one(i) for i in range(24)])
            await held
            return results

        results = asyncio.run(main())
        statuses = sorted(r[0] for r in results)
        assert statuses.count(200) >= 3 and statuses.count(503) >= 10, statuses
        for status, text, retry_after in results:
            if status == 503:
                assert json.loads(text)["error"]["code"] == "overloaded" and retry_after == "1"
        status, _, _ = srv.post("/v1/completions", {"prompt": "Hello", "max_tokens": 2})
        assert status == 200
        srv.wait_idle()
