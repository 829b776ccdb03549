"""AsyncLLM: the engine behind an asyncio interface, as the API server sees it.

The engine itself lives in an engine core (`tandem.engine.core`), by default in a process
of its own (`tandem.engine.core_client`), so that its Python work never competes with the event
loop for the GIL. Here requests are admitted, registered and sent; each engine step comes back as
one message, whose outputs are dropped into the requests' streams with one
`call_soon_threadsafe` per event loop.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import itertools
import threading
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

from tandem.config import EngineConfig
from tandem.engine.core import (
    ABORT,
    ADD,
    UTILITY,
    EngineCoreOutputs,
    EngineError,
    EngineInfo,
    EngineUnavailable,
)
from tandem.engine.core_client import ENGINE_MODES, EngineCoreConns, MPClient, make_client
from tandem.engine.detokenizer import DeltaText
from tandem.engine.llg_tokenizer import vocabulary_refusal
from tandem.engine.llm_engine import LLMEngine, PromptType
from tandem.engine.metrics import EngineStats, ServerMetrics
from tandem.engine.microbatch_tokenizer import MicrobatchTokenizer
from tandem.engine.request_stream import RequestStream
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams

__all__ = ["AsyncLLM", "EngineError", "EngineUnavailable", "Overloaded", "TooLarge"]


class Overloaded(RuntimeError):
    """Admission control: too many sequences wait already."""


class TooLarge(ValueError):
    """Admission control: one submission holds more sequences than the waiting queue ever may."""


class AsyncLLM:
    """An engine core behind `submit`/`generate`, `abort`, `call`/`call_utility`, `stats`.

    `engine_mode` "process" runs the engine in a spawned process, "thread" in a thread of this
    one (then `engine_core.engine` is the engine itself, for tests and tools). With `attach_to`
    (an API server of several, `tandem serve --api-server-count`) it uses an engine-core process
    started elsewhere, through these pipes, and `config` and `engine_mode` are not used.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        max_waiting_requests: int | None = None,
        engine_mode: str = ENGINE_MODES[0],
        attach_to: tuple[EngineCoreConns, EngineInfo] | None = None,
    ):
        self.max_waiting_requests = max_waiting_requests
        self.metrics = ServerMetrics()
        self.stats = EngineStats()
        # request id -> its stream, its index there, and its text when it is made here (DeltaText)
        self._live: dict[str, tuple[RequestStream, int, DeltaText | None]] = {}
        self._calls: dict[int, tuple[asyncio.Future, asyncio.AbstractEventLoop]] = {}
        self._call_ids = itertools.count()
        self._lock = threading.Lock()  # orders registrations against the core's exit
        self._error: EngineUnavailable | None = None  # set once the core is gone
        self._num_submitted = 0  # sequences sent in add commands (under _lock)
        self._stopping = False
        self.engine_died = False  # the core went away without being told to stop
        self.on_engine_death: Callable[[], None] | None = None  # called then, from its thread
        if attach_to is not None:
            self.engine_mode = "process"
            self.engine_core = MPClient(*attach_to, self._on_outputs, self._on_exit)
        else:
            self.engine_mode = engine_mode
            config = config.for_serving() if config is not None else None
            self.engine_core = make_client(engine_mode, config, self._on_outputs, self._on_exit)
        info = self.engine_core.info
        self.tokenizer = info.tokenizer
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.device = info.device
        # Tokenizing and rendering chat templates take time in proportion to the prompt: in a
        # thread of their own, so the event loop answers everyone else meanwhile (one thread:
        # an HF tokenizer is not safe to use from several at once).
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tandem-tokenizer")
        # prompts are encoded there in batches: what arrives during one batch makes the next
        self._encoder = (MicrobatchTokenizer(info.tokenizer, self._tokenizer_thread)
                         if info.tokenizer is not None else None)
        # Streamed text is made here, from the deltas' token ids, on the thread that reads the
        # engine's outputs (`_makes_text`): its own copy of the tokenizer, for the same reason.
        self._text_tokenizer = copy.deepcopy(info.tokenizer) if info.tokenizer is not None else None
        self.max_prompt_chars = _max_prompt_chars(self.tokenizer, self.max_model_len)
        # whether llguidance reads the tokenizer's vocabulary as it encodes (every grammar mask is
        # over those bytes): checked once, here, so that no request waits for it (0.4 s for
        # SmolLM2's 49k tokens on the development CPU)
        self._vocabulary_refusal = (vocabulary_refusal(info.tokenizer, info.vocab_size)
                                    if info.tokenizer is not None else None)
        # what LLMEngine.validate_request reads: its limits, not its state
        self._limits = SimpleNamespace(
            max_model_len=info.max_model_len, hf_config=SimpleNamespace(vocab_size=info.vocab_size),
            config=SimpleNamespace(host_only=info.host_only),
        )

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs) -> AsyncLLM:
        return cls(config, **kwargs)

    @property
    def is_alive(self) -> bool:
        return self._error is None and self.engine_core.is_alive

    @property
    def is_sleeping(self) -> bool:
        return self.stats.is_sleeping

    @property
    def weights_version(self) -> int:
        return self.stats.weights_version

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """The engine's own checks, run here so that bad input never reaches the engine and the
        error text stays the engine's; raises ValueError."""
        LLMEngine.validate_request(self._limits, prompt_token_ids, params)  # type: ignore[arg-type]
        if params.structured_outputs is not None and self._vocabulary_refusal is not None:
            raise ValueError(self._vocabulary_refusal)

    # -- the event loop side ---------------------------------------------------------------------
    def submit(
        self,
        requests: list[tuple[str, PromptType, SamplingParams]],
        output_kind: str = "delta",
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> RequestStream:
        """Queue requests (prompts validated already) and return the stream of their outputs,
        read on `loop` (the running one by default: another thread, the tokenizer's, names the
        loop that will read it).

        Admission control counts sequences (prompts x n): raises Overloaded when they would
        overfill the waiting queue, TooLarge when they never could.
        """
        num_seqs = sum(params.n for _, _, params in requests)
        if self.max_waiting_requests is not None and num_seqs > self.max_waiting_requests:
            raise TooLarge(
                f"{len(requests)} prompts x n make {num_seqs} sequences, more than this "
                f"server ever queues ({self.max_waiting_requests}); send fewer prompts or a "
                "lower n"
            )
        stream = RequestStream(self, requests, output_kind, loop)
        adds, texts = [], []
        for rid, prompt, params in requests:
            text = None
            if self._text_tokenizer is not None and _makes_text(params, output_kind):
                text = DeltaText(self._text_tokenizer, params.skip_special_tokens)
                params = params.clone(detokenize=False)  # the engine sends token ids only
            adds.append((ADD, rid, prompt, params, output_kind))
            texts.append(text)
        with self._lock:  # (requests come from the event loop and from the tokenizer's thread)
            if self._error is not None:
                raise self._error
            if self.max_waiting_requests is not None:
                stats = self.stats
                waiting = stats.num_waiting_seqs + self._num_submitted - stats.num_added
                if waiting + num_seqs > self.max_waiting_requests:
                    self.metrics.rejected += 1
                    raise Overloaded(
                        f"the server is at capacity ({waiting} sequences waiting, at most "
                        f"{self.max_waiting_requests}); retry later"
                    )
            for i, (rid, _, _) in enumerate(requests):
                self._live[rid] = (stream, i, texts[i])
            self.engine_core.send(adds)
            self._num_submitted += num_seqs
        return stream

    async def generate(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        output_kind: str = "delta",
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as the engine produces them; closing the iterator aborts it."""
        async for _, out in self.submit([(request_id, prompt, params)], output_kind):
            yield out

    def abort(self, request_ids: str | list[str]) -> None:
        """Abort requests (no-op for finished or unknown ones); safe from any thread."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            self._live.pop(rid, None)
        if ids and self._error is None:
            self.engine_core.send([(ABORT, ids)])  # one that comes too late has nothing to abort

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Run the engine core's utility `method(*args)` between two steps; return its result
        (or raise its error) here."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            if self._error is not None:
                raise self._error
            call_id = next(self._call_ids)
            self._calls[call_id] = (fut, loop)
            try:
                self.engine_core.send([(UTILITY, call_id, method, args)])
            except BaseException:
                del self._calls[call_id]
                raise
        return await fut

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(engine, *args)` in the engine core, between two steps. In process mode `fn` and
        its result travel by pickle: a module-level function, a picklable result."""
        return await self.call_utility("call", fn, *args)

    async def encode(self, text: str, then: Callable[[list[int]], Any] | None = None,
                     undo: Callable[[Any], None] | None = None, **kwargs: Any) -> Any:
        """`tokenizer.encode(text, **kwargs)` in the tokenizer's thread, batched with the texts
        that wait beside it; with `then`, `then(ids)` there too (`MicrobatchTokenizer.encode`)."""
        if self._encoder is None:
            raise ValueError("this model has no tokenizer: send token ids")
        return await self._encoder.encode(text, then, undo, **kwargs)

    async def run_tokenizer(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` (tokenizer work) in the tokenizer's thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._tokenizer_thread, functools.partial(fn, *args, **kwargs)
        )

    def fail_in_flight(self, reason: str) -> None:
        """Fail every request in flight with EngineUnavailable(reason) and abort it in the
        engine (a graceful shutdown's grace period is over); safe from any thread."""
        error = EngineUnavailable(reason)
        with self._lock:
            live, self._live = self._live, {}
        _fail_streams(live.values(), error)
        if live and self._error is None:
            self.engine_core.send([(ABORT, list(live))])

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Abort what is in flight and stop the engine core."""
        self._stopping = True
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)
        if self._encoder is not None:
            self._encoder.close(EngineUnavailable("the server is shutting down"))
        self.engine_core.shutdown(timeout)

    # -- the engine core's side (its thread, or the thread reading its process) -------------------
    def _on_outputs(self, msg: EngineCoreOutputs) -> None:
        if msg.stats is not None:
            self.stats = msg.stats  # before the replies: an awaited /sleep sees is_sleeping
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        live = self._live
        for out in msg.outputs:
            entry = live.pop(out.request_id, None) if out.finished else live.get(out.request_id)
            if entry is not None:
                stream, i, text = entry
                if text is not None:
                    text.fill(out)
                by_loop[stream.loop].append((stream, i, out))
        for rid, error in msg.failed:
            entry = live.pop(rid, None)
            if entry is not None:
                by_loop[entry[0].loop].append((entry[0], entry[1], error))
        for loop, items in by_loop.items():
            _put_all(loop, items)
        for call_id, result, error in msg.replies:
            fut, loop = self._calls.pop(call_id, (None, None))
            if fut is not None:
                _call_soon(loop, _set_future, fut, result, error)

    def _on_exit(self, error: EngineUnavailable) -> None:
        """The core is gone: nobody may wait forever, and nothing new is accepted."""
        with self._lock:
            self._error = error
            live, self._live = self._live, {}
            calls, self._calls = self._calls, {}
        _fail_streams(live.values(), error)
        for fut, loop in calls.values():
            _call_soon(loop, _set_future, fut, None, error)
        if not self._stopping:  # nobody asked it to stop: the server cannot serve any more
            self.engine_died = True
            if self.on_engine_death is not None:
                self.on_engine_death()


def _max_prompt_chars(tokenizer, max_model_len: int) -> int | None:
    """The most characters a text that fits in `max_model_len` tokens can have: no token's text
    is longer than its vocabulary entry (byte-level and SentencePiece entries spell each byte or
    character once). Longer prompts are refused before they are tokenized."""
    if tokenizer is None:
        return None
    try:
        longest = max(len(t) for t in tokenizer.get_vocab())
    except (AttributeError, TypeError, ValueError):
        return None
    return max_model_len * max(longest, 1)


def _makes_text(params: SamplingParams, output_kind: str) -> bool:
    """Whether a request's text is made in this process from its deltas' token ids rather than
    in the engine (vLLM V1 detokenizes in its frontend): streamed deltas, unless the engine
    needs the text itself (stop strings are matched there) or sends text with the tokens
    (logprobs' decoded tokens). Detokenizing is the largest part of the engine loop's Python
    for a streamed token, and that loop paces the device when the host is slow."""
    return (output_kind == "delta" and params.detokenize and not params.stop_strings
            and params.logprobs is None and params.prompt_logprobs is None)


def _fail_streams(entries, error: BaseException) -> None:
    by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
    for stream, i, _ in entries:
        by_loop[stream.loop].append((stream, i, error))
    for loop, items in by_loop.items():
        _put_all(loop, items)


def _put_all(loop: asyncio.AbstractEventLoop, items: list) -> None:
    def put() -> None:
        for stream, i, item in items:
            stream.queue.put_nowait((i, item))

    _call_soon(loop, put)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass  # the loop is closed: nobody is waiting any more


def _set_future(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
