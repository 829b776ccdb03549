"""Streamed chunks are encoded from per-request templates where only the text changes: their
bytes must equal the plain JSON encoding (compact separators, ASCII escapes) of the OpenAI chunk,
for completions and chat, with and without logprobs, n > 1, finish and usage chunks."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from tandem.outputs import CompletionOutput, Logprob, RequestOutput
from tandem.serve.chat import OpenAIServingChat
from tandem.serve.completions import OpenAIServingCompletion
from tandem.serve.protocol import ChatCompletionRequest, CompletionRequest
from tandem.serve.serving import HOLE, sse, sse_template

TEXTS = ["", "plain", " Café — “quoted” 東京 😀", 'esc "\\ \n\t\r\x00\x1f', "\ud800 lone", "a</script>"]
RID, MODEL, CREATED = "cmpl-0", "org/model-ü", 1700000000


def _want(event: dict) -> str:
    """What the server sent before templates: the whole chunk through json's encoder."""
    return f"data: {json.dumps(event, separators=(',', ':'))}\n\n"


@pytest.mark.parametrize("text", TEXTS)
def test_template_equals_whole_encoding(text):
    event = {"id": RID, "model": MODEL, "choices": [{"index": 3, "text": HOLE, "x": None}]}
    filled = {"id": RID, "model": MODEL, "choices": [{"index": 3, "text": text, "x": None}]}
    assert sse_template(event)(text) == sse(filled) == _want(filled)


def _delta(rid, index, text, ids, finish=None, logprobs=None, cached=0):
    c = CompletionOutput(index, text, ids, None, logprobs, finish, None)
    return RequestOutput(rid, None, [1, 2, 3], [c], finished=finish is not None,
                         num_cached_tokens=cached)


def _lp(token_id: int, text: str) -> dict:
    return {token_id: Logprob(-0.5, 1, text), token_id + 1: Logprob(-1.5, 2, "alt")}


def _events(serving, req, outputs, *args) -> list[str]:
    async def stream():
        for item in outputs:
            yield item

    async def collect():
        return [e async for e in serving._events(req, RID, stream(), *args)]

    return asyncio.run(collect())


def _serving(cls):
    llm = SimpleNamespace(tokenizer=None)
    serving = cls(llm, MODEL)
    return serving


def _stream_outputs(n: int, logprobs: bool) -> list[tuple[int, RequestOutput]]:
    """Prompt 0's samples interleaved, each three deltas (the last finishing), unicode text."""
    outs = []
    for step, text in enumerate(TEXTS[1:4]):
        for j in range(n):
            finish = "length" if step == 2 else None
            ids = [10 + step, 20 + step]
            lps = [_lp(t, text[:1] or "?") for t in ids] if logprobs else None
            outs.append((0, _delta("cmpl-0-0", j, f"{text}{j}", ids, finish, lps, cached=2)))
    return outs


def _completion_choice(index, text, finish=None, logprobs=None):
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
            "stop_reason": None}


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("include_usage", [False, True])
def test_completion_chunks_byte_identical(n, include_usage):
    body = {"prompt": "x", "stream": True, "n": n}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    req = CompletionRequest(**body)
    got = _events(_serving(OpenAIServingCompletion), req, _stream_outputs(n, False), 3)
    want = []
    for _, out in _stream_outputs(n, False):
        c = out.outputs[0]
        want.append(_want({"id": RID, "object": "text_completion", "created": CREATED,
                           "model": MODEL,
                           "choices": [_completion_choice(c.index, c.text, c.finish_reason)]}))
    if include_usage:
        usage = {"prompt_tokens": 3, "completion_tokens": 6 * n, "total_tokens": 3 + 6 * n,
                 "prompt_tokens_details": {"cached_tokens": 2}}
        want.append(_want({"id": RID, "object": "text_completion", "created": CREATED,
                           "model": MODEL, "choices": [], "usage": usage}))
    assert [_fix_created(e) for e in got] == want


def test_completion_logprob_chunks_byte_identical():
    req = CompletionRequest(prompt="x", stream=True, logprobs=1)
    got = _events(_serving(OpenAIServingCompletion), req, _stream_outputs(1, True), 3)
    offset = 0
    for event, (_, out) in zip(got, _stream_outputs(1, True), strict=True):
        c = out.outputs[0]
        tok = c.text[:1] or "?"
        lps = {"tokens": [tok, tok], "token_logprobs": [-0.5, -0.5],
               "top_logprobs": [{tok: -0.5, "alt": -1.5}] * 2,
               "text_offset": [offset, offset + len(tok)]}
        offset += len(c.text)
        assert _fix_created(event) == _want(
            {"id": RID, "object": "text_completion", "created": CREATED, "model": MODEL,
             "choices": [_completion_choice(0, c.text, c.finish_reason, lps)]})


def _chat_chunk(choice: dict, **extra) -> dict:
    return {"id": RID, "object": "chat.completion.chunk", "created": CREATED, "model": MODEL,
            "choices": [choice] if choice else [], **extra}


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("logprobs", [False, True])
@pytest.mark.parametrize("continuous", [False, True])
def test_chat_chunks_byte_identical(n, logprobs, continuous):
    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], stream=True, n=n, logprobs=logprobs,
        top_logprobs=1 if logprobs else None,
        stream_options={"include_usage": True, "continuous_usage_stats": continuous})
    got = _events(_serving(OpenAIServingChat), req, _stream_outputs(n, logprobs), [1, 2, 3])

    def usage(generated, cached=0):
        return {"prompt_tokens": 3, "completion_tokens": generated,
                "total_tokens": 3 + generated, "prompt_tokens_details": {"cached_tokens": cached}}

    per_chunk = (lambda g: {"usage": usage(g)}) if continuous else (lambda g: {})
    want = [_want(_chat_chunk({"index": j, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None}, **per_chunk(0)))
            for j in range(n)]
    generated = 0
    for _, out in _stream_outputs(n, logprobs):
        c = out.outputs[0]
        generated += len(c.token_ids)
        lps = None
        if logprobs:
            tok = c.text[:1] or "?"
            item = {"token": tok, "logprob": -0.5, "bytes": list(tok.encode()),
                    "top_logprobs": [{"token": tok, "logprob": -0.5, "bytes": list(tok.encode())}]}
            lps = {"content": [item, item]}
        want.append(_want(_chat_chunk(
            {"index": c.index, "delta": {"content": c.text}, "logprobs": lps,
             "finish_reason": c.finish_reason, "stop_reason": None}, **per_chunk(generated))))
    want.append(_want(_chat_chunk(None, usage=usage(generated, cached=2))))
    assert [_fix_created(e) for e in got] == want


def _fix_created(event: str) -> str:
    """The chunk with its `created` (the clock's) replaced by CREATED."""
    head, _, rest = event.partition('"created":')
    return f'{head}"created":{CREATED}{rest[rest.index(","):]}'
