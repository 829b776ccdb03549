"""What the completion and chat endpoints share: prompt checks, sampling parameters, the
server-sent-event framing, usage, and cancelling a request whose client went away."""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import ClassVar

from fastapi import Request
from fastapi.responses import Response

from tandem.engine.async_llm import (
    AsyncLLM,
    EngineError,
    EngineUnavailable,
    Overloaded,
    TooLarge,
)
from tandem.engine.request_stream import RequestStream
from tandem.outputs import Logprob, RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.serve.errors import APIError, error_body, from_value_error
from tandem.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    constraint_field,
    reject_unsupported,
    sampling_params,
)

_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps to the same value


class ClientDisconnected(Exception):
    pass


class OpenAIServing:
    """Base of the endpoints: one engine, one served model name."""

    request_fields: ClassVar[frozenset[str]] = frozenset()  # for naming `param` in errors

    def __init__(self, llm: AsyncLLM, model_name: str, retry_after_s: int = 1):
        self.llm = llm
        self.model_name = model_name
        self.retry_after_s = retry_after_s

    # -- checks, before anything reaches the engine ----------------------------------------------
    def check_request(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        if req.model is not None and req.model != self.model_name:
            raise APIError(
                f"model {req.model!r} does not exist; this server serves {self.model_name!r}",
                404,
                param="model",
                code="model_not_found",
            )
        reject_unsupported(req)
        bad = [t for t in req.stop_token_ids or [] if not 0 <= t < self.llm.vocab_size]
        if bad:
            raise APIError(
                f"stop_token_ids: {bad[:5]} are outside the vocabulary [0, {self.llm.vocab_size})",
                param="stop_token_ids",
            )

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """A 400 for text too long to fit the context whatever it says, before any tokenizing."""
        limit = self.llm.max_prompt_chars
        if limit is not None and num_chars > limit:
            raise APIError(
                f"{param}: {num_chars} characters cannot fit this model's maximum context length "
                f"of {self.llm.max_model_len} tokens (at most {limit} characters)",
                param=param,
                code="context_length_exceeded",
            )

    async def encode(self, text: str, param: str, then=None, undo=None, **kwargs):
        """Token ids of `text`, encoded off the event loop; a 400 for text too long to fit, or
        not valid Unicode (a lone surrogate, which JSON can carry and the tokenizer cannot take).
        With `then`: what `then(ids)` returns, run on the tokenizer's thread (`AsyncLLM.encode`)."""
        self.check_prompt_chars(len(text), param)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(
                f"{param}: not valid Unicode ({e.reason} at {e.start})",
                param=param,
                code="invalid_unicode",
            ) from None
        return await self.llm.encode(text, then, undo, **kwargs)

    async def encode_and_submit(
        self,
        text: str,
        param: str,
        output_kind: str,
        build: Callable[[list[int]], list[tuple[str, dict, SamplingParams]]],
        **kwargs,
    ) -> tuple[list[int], RequestStream]:
        """`text` encoded, and the requests `build(ids)` makes of it (checked there) handed to
        the engine on the tokenizer's thread as soon as its batch is encoded; the ids and the
        stream. Resuming this handler on the event loop first would hand the request over only
        after everything queued before it: in a burst, every other request's parsing and checks,
        while the engine waits (docs/benchmarks.md). A 400 from `build` or `submit` is raised
        here as before; a client gone meanwhile has its requests aborted."""
        loop = asyncio.get_running_loop()

        def then(ids: list[int]) -> tuple[list[int], RequestStream]:
            return ids, self.submit(build(ids), output_kind, loop)

        def undo(result: tuple[list[int], RequestStream]) -> None:
            self.llm.abort(result[1].request_ids)

        return await self.encode(text, param, then, undo, **kwargs)

    def make_params(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        prompt_ids: list[int],
        max_tokens_field: str,
        logprobs: int | None,
        prompt_field: str,
    ) -> SamplingParams:
        """Sampling parameters for one prompt; the prompt and max_tokens checked against the
        context length. Every failure is a 400 naming the field."""
        room = self.llm.max_model_len - len(prompt_ids)  # >= 1 unless the prompt is too long
        value = getattr(req, max_tokens_field)
        if max_tokens_field in req.model_fields_set and value is not None:
            if 0 < room < value:
                raise APIError(
                    f"{max_tokens_field}: this model's maximum context length is "
                    f"{self.llm.max_model_len} tokens, but you asked for {len(prompt_ids) + value} "
                    f"({len(prompt_ids)} in the prompt, {value} to generate); lower "
                    f"{max_tokens_field} to at most {room}",
                    param=max_tokens_field,
                    code="context_length_exceeded",
                )
            max_tokens = max(value, 1)  # (0: scoring with echo, one token generated and dropped)
        else:  # the default (16 for completions), or what fits the context
            max_tokens = max(1, min(value or room, room))  # (validate_request flags a long prompt)
        try:
            params = sampling_params(req, max_tokens, logprobs)
            self.llm.validate_request(prompt_ids, params)
        except (ValueError, TypeError) as e:
            rename = {  # the engine's names for what the request calls otherwise
                "prompt_token_ids": prompt_field,
                "prompt": prompt_field,
                "max_tokens": max_tokens_field,
                "logprobs": _logprobs_field(req),
                "structured_outputs": constraint_field(req),
            }
            raise from_value_error(e, self.request_fields, rename) from None
        return params

    def submit(
        self,
        requests: list[tuple[str, dict, SamplingParams]],
        output_kind: str,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> RequestStream:
        """Hand checked requests to the engine, or answer 503 (queue full, engine asleep/gone);
        `loop`: where the stream is read, when this runs on another thread."""
        retry = {"Retry-After": str(self.retry_after_s)}
        if self.llm.is_sleeping:
            raise APIError(
                "the engine is asleep (admin /sleep); retry after /wake_up",
                503,
                code="engine_asleep",
                headers=retry,
            )
        try:
            return self.llm.submit(requests, output_kind, loop)
        except Overloaded as e:
            raise APIError(str(e), 503, code="overloaded", headers=retry) from None
        except TooLarge as e:  # a retry cannot help
            param = "n" if len(requests) == 1 else "prompt"
            raise APIError(str(e), param=param, code="too_many_sequences") from None
        except EngineUnavailable as e:
            raise APIError(str(e), 503, code="engine_unavailable") from None

    # -- running ---------------------------------------------------------------------------------
    async def run_to_end(self, raw: Request, stream: RequestStream) -> list[RequestOutput] | None:
        """Final outputs of all requests; None (and aborted) if the client disconnects first."""
        finals: list[RequestOutput | None] = [None] * len(stream.request_ids)

        async def collect() -> None:
            async for i, out in stream:
                finals[i] = out

        try:
            await until_disconnect(raw, collect())
        except ClientDisconnected:
            return None
        except EngineError as e:
            raise APIError(str(e), 500, code="engine_error") from None
        except EngineUnavailable as e:
            raise APIError(str(e), 503, code="engine_unavailable") from None
        return finals  # type: ignore[return-value]

    def event_stream(self, events: AsyncIterator[str], stream: RequestStream) -> Response:
        """A `text/event-stream` response of the events (`sse` strings) ending in
        `data: [DONE]`; when the client goes away its requests are aborted."""
        return EventStreamResponse(events, stream)


class EventStreamResponse(Response):
    """Server-sent events written straight to the ASGI `send` (Starlette's StreamingResponse adds
    an anyio task group per request and a generator layer per event), from a task of their own:
    resumed for every event, the request's task would resume each middleware's frame on the way.
    Another task watches for the client going away, and aborts the stream's requests then, which
    ends the events."""

    def __init__(self, events: AsyncIterator[str], stream: RequestStream):
        self.events = events
        self.stream = stream
        self.status_code = 200
        self.raw_headers = list(_SSE_HEADERS)
        self.background = None  # (FastAPI sets it: a route's background tasks)

    async def __call__(self, scope, receive, send) -> None:
        sending = asyncio.ensure_future(self._send_events(send))
        watcher = asyncio.ensure_future(_abort_on_disconnect(receive, self.stream))
        try:
            await sending
        finally:
            watcher.cancel()
            sending.cancel()  # (still running only if this task was cancelled)
            self.stream.abort()
        if self.background is not None:
            await self.background()

    async def _send_events(self, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        try:
            async for event in self.events:
                await send({"type": "http.response.body", "body": event.encode(),
                            "more_body": True})
        except (EngineError, EngineUnavailable) as e:
            status = 500 if isinstance(e, EngineError) else 503
            event = sse(error_body(str(e), status))
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def _abort_on_disconnect(receive, stream: RequestStream) -> None:
    await _wait_for_disconnect(receive)
    stream.abort()


def sse(event: dict) -> str:
    """One server-sent event: `data: <the event's JSON>` and a blank line."""
    return f"data: {_dumps(event)}\n\n"


def sse_template(event: dict) -> Callable[[str], str]:
    """`sse(event)` as a function of its one string that is `HOLE`: the rest is encoded once (a
    request's streamed deltas differ only in their text), per event only that string, by the
    encoder's own string function, so the bytes equal `sse`'s."""
    head, tail = sse(event).split(_encode_str(HOLE))
    return lambda text: f"{head}{_encode_str(text)}{tail}"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},  # served by the prefix cache
    }


def token_str(token_id: int, lp: Logprob | None) -> str:
    """A token's text; without a tokenizer, vLLM's `token_id:<id>` form."""
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return f"token_id:{token_id}"


def prompt_logprobs_json(entries: list[dict[int, Logprob] | None] | None) -> list | None:
    """vLLM's `prompt_logprobs` field: None for the first token, then {token id: {logprob, rank,
    decoded_token}} per prompt token."""
    if entries is None:
        return None
    return [None if e is None else {
        str(t): {"logprob": finite(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
        for t, lp in e.items()} for e in entries]


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _MIN_LOGPROB


async def until_disconnect(request: Request, work: Awaitable) -> None:
    """Await `work`, cancelling it (which aborts its engine requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task not in done:
        raise ClientDisconnected()
    task.result()


async def _wait_for_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def disconnected_response() -> Response:
    return Response(status_code=499)  # nginx's "client closed request": nobody reads it


def _logprobs_field(req) -> str:
    return "top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs"


# One encoder for every chunk: json.dumps with non-default separators builds a new JSONEncoder
# per call, which costs a third of a small chunk's encoding (5.6 -> 3.6 us, measured).
_dumps = json.JSONEncoder(separators=(",", ":")).encode
_encode_str = json.encoder.encode_basestring_ascii  # what _dumps (ensure_ascii) does to a str
# The stand-in for a template's string: NULs, which the rest of a chunk (our request ids, a
# model name from the command line) cannot hold
HOLE = "\0tandem-template-hole\0"
_SSE_HEADERS = [  # StreamingResponse's for media_type="text/event-stream", Cache-Control: no-cache
    (b"cache-control", b"no-cache"),
    (b"content-type", b"text/event-stream; charset=utf-8"),
]
