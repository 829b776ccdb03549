"""The streaming client: SSE parsing as vLLM streams, payloads, and how failures are recorded."""

import asyncio
import json

import pytest

from tandem.bench.client import TargetConfig, build_payload, consume_event, run_requests
from tandem.bench.datasets import RequestSpec
from tandem.bench.metrics import RequestRecord


def ev(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode()


def test_completion_events_and_usage():
    r = RequestRecord(0)
    assert not consume_event(r, ev({"choices": [{"text": "a", "finish_reason": None}]}), 1.0, False)
    consume_event(r, ev({"choices": [{"text": "", "finish_reason": None}]}), 2.0, False)  # mid-char
    consume_event(r, ev({"choices": [{"text": "", "finish_reason": "length"}]}), 3.0, False)
    consume_event(
        r, ev({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}}), 4.0, False
    )
    assert r.token_times == [1.0, 2.0]  # the bare finish marker and usage chunk are no tokens
    assert (r.usage_prompt_tokens, r.usage_completion_tokens) == (7, 2)
    assert consume_event(r, b"data: [DONE]", 5.0, False)


def test_chat_role_header_is_not_a_token():
    r = RequestRecord(0)
    role = {"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    consume_event(r, ev(role), 1.0, True)
    consume_event(r, ev({"choices": [{"delta": {"content": "hi"}}]}), 2.0, True)
    consume_event(r, ev({"choices": [{"delta": {"reasoning_content": "hmm"}}]}), 3.0, True)
    assert r.token_times == [2.0, 3.0]


def test_comments_and_error_events():
    r = RequestRecord(0)
    consume_event(r, b": keep-alive", 1.0, False)
    consume_event(r, ev({"error": {"message": "out of memory"}}), 2.0, False)
    assert r.token_times == [] and r.error == "stream error: out of memory"


def test_payload_forces_output_length():
    spec = RequestSpec("hello there", 2, 17)
    body = json.loads(build_payload(spec, TargetConfig(), "m"))
    assert body["max_tokens"] == body["min_tokens"] == 17 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["prompt"] == "hello there" and body["model"] == "m"
    chat = json.loads(
        build_payload(spec, TargetConfig(endpoint="chat", extra_body='{"top_p": 0.5}'), "m")
    )
    assert chat["messages"] == [{"role": "user", "content": "hello there"}]
    assert chat["max_completion_tokens"] == 17 and chat["top_p"] == 0.5
    plain = json.loads(build_payload(spec, TargetConfig(ignore_eos=False), "m"))
    assert "ignore_eos" not in plain and "min_tokens" not in plain


def test_target_normalises_url_and_endpoint():
    t = TargetConfig(base_url="http://127.0.0.1:9/v1/", endpoint="chat")
    assert (t.base_url, t.endpoint, t.is_chat) == (
        "http://127.0.0.1:9",
        "/v1/chat/completions",
        True,
    )
    with pytest.raises(ValueError, match="extra_body"):
        TargetConfig(extra_body="[1]")


def _run(base_url, n=4, out=5, endpoint="/v1/completions", **kw):
    target = TargetConfig(base_url=base_url, endpoint=endpoint)
    bodies = [build_payload(RequestSpec(f"p {i}", 2, out), target, "m") for i in range(n)]
    recs = [RequestRecord(i, 2, out) for i in range(n)]
    sent, t0 = asyncio.run(run_requests(target, bodies, recs, [0.0] * n, **kw))
    return sent, t0


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("finish_chunk", [False, True])
def test_streams_record_every_token(stub, endpoint, finish_chunk):
    with stub(tpot_ms=2, finish_chunk=finish_chunk) as server:
        sent, t0 = _run(server.base_url, endpoint=endpoint)
        payload = server.payloads[0]
    assert all(r.ok for r in sent), [r.error for r in sent]
    assert [len(r.token_times) for r in sent] == [5] * 4
    assert all(r.usage_completion_tokens == 5 and r.usage_prompt_tokens == 2 for r in sent)
    assert all(t0 <= r.t_start < r.token_times[0] <= r.t_end for r in sent)
    assert payload["stream_options"] == {"include_usage": True}


def test_events_split_across_reads_with_crlf(stub):
    with stub(tpot_ms=1, split_events=True) as server:
        sent, _ = _run(server.base_url, n=2, out=4)
    assert all(r.ok for r in sent), [r.error for r in sent]
    assert [len(r.token_times) for r in sent] == [4, 4]
    # a token is timed when its event is complete: after the 2 ms pause inside each event
    assert all(b - a >= 0.0015 for r in sent for a, b in zip(r.token_times, r.token_times[1:]))


def test_failures_are_recorded_not_raised(stub):
    with stub(tpot_ms=1, fail_every=4, error_every=3, drop_every=5) as server:
        sent, _ = _run(server.base_url, n=10, out=6)
    errors = {r.index: r.error for r in sent if not r.ok}
    kinds = sorted({e.split(":")[0] for e in errors.values()})
    assert "HTTP 500" in kinds and "stream error" in kinds
    assert any("ClientPayloadError" in e or "without [DONE]" in e for e in errors.values())
    assert len(sent) == 10 and len(errors) >= 5


def test_unreachable_server():
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sent, _ = _run(f"http://127.0.0.1:{port}", n=2)
    assert not any(r.ok for r in sent) and "Connect" in sent[0].error


def test_max_concurrency_caps_in_flight(stub):
    with stub(tpot_ms=3) as server:
        sent, _ = _run(server.base_url, n=12, out=4, max_concurrency=3)
        assert server.max_in_flight == 3
    assert all(r.ok for r in sent)


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("finish_chunk", [False, True])
def test_a_stream_may_end_without_done_once_its_choice_finished(stub, endpoint, finish_chunk):
    """`transformers serve` ends with a chunk carrying finish_reason (and usage), then EOF."""
    with stub(tpot_ms=1, send_done=False, finish_chunk=finish_chunk) as server:
        sent, _ = _run(server.base_url, endpoint=endpoint)
    assert all(r.ok for r in sent), [r.error for r in sent]
    assert [len(r.token_times) for r in sent] == [5] * 4


def test_a_stream_that_ends_unfinished_without_done_fails():
    r = RequestRecord(0)
    assert not consume_event(r, ev({"choices": [{"index": 0, "text": " a", "finish_reason": None}]}),
                             1.0, False)
    assert not r.finished
    consume_event(r, ev({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}), 2.0, False)
    assert r.finished


def test_a_burst_sends_each_request_as_it_is_dispatched():
    """All at once, request 0 reaches the server while the rest of the burst is still being
    dispatched, not after every request's set-up. Server and client share one event loop, so
    the order is the loop's, not the machine's timing."""
    from aiohttp import web

    n = 64
    recs = [RequestRecord(i, 2, 1) for i in range(n)]
    dispatched_when_first_arrived: list[int] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        if not dispatched_when_first_arrived:
            dispatched_when_first_arrived.append(sum(r.t_dispatched > 0 for r in recs))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(ev({"choices": [{"index": 0, "text": " a", "finish_reason": "length"}]})
                         + b"\n\ndata: [DONE]\n\n")
        return resp

    async def main():
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            port = runner.addresses[0][1]
            target = TargetConfig(base_url=f"http://127.0.0.1:{port}")
            bodies = [build_payload(RequestSpec(f"p {i}", 2, 1), target, "m") for i in range(n)]
            return await run_requests(target, bodies, recs, [0.0] * n)
        finally:
            await runner.cleanup()

    sent, _ = asyncio.run(main())
    assert all(r.ok for r in sent), [r.error for r in sent]
    assert dispatched_when_first_arrived[0] < n // 2, dispatched_when_first_arrived
