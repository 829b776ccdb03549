"""AsyncLLM: one LLMEngine stepped by one dedicated thread, fed and drained from asyncio.

The engine is not thread-safe, so every add, abort and admin call reaches it as a command on a
queue, and only the engine thread touches it. Requests from every connection join the same
continuous batch; each step's outputs go back to the event loop in one `call_soon_threadsafe`.
With nothing to run the thread sleeps on the queue (no busy spin).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from typing import Any

from tandem.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine, PromptType
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.serve.metrics import EngineStats, ServerMetrics
from tandem.serve.request_stream import RequestStream

logger = logging.getLogger("tandem.serve")

_STOP = object()


class EngineError(RuntimeError):
    """The engine failed while running a request (its step raised); the request is gone."""


class EngineUnavailable(RuntimeError):
    """The engine refused or dropped the request through no fault of it: asleep, without valid
    weights, or shutting down."""


class Overloaded(RuntimeError):
    """Admission control: too many requests wait already."""


class AsyncLLM:
    """An LLMEngine behind an asyncio interface: `submit`/`generate`, `abort`, `call`, `stats`."""

    def __init__(self, engine: LLMEngine, max_waiting_requests: int | None = None):
        self.engine = engine
        # A private copy for the event loop (prompts, chat templates): HF tokenizers are not
        # safe to share with the engine thread, which detokenizes while we encode.
        self.tokenizer = copy.deepcopy(engine.tokenizer) if engine.tokenizer is not None else None
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.hf_config.vocab_size
        self.max_waiting_requests = max_waiting_requests
        self.metrics = ServerMetrics()
        self.stats = self._snapshot(0)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders submissions against the engine thread's exit
        self._stopped = False
        self._num_submitted = 0  # add commands queued (event loop side)
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs) -> AsyncLLM:
        return cls(LLMEngine(config), **kwargs)

    @property
    def is_alive(self) -> bool:
        return not self._stopped and self._thread.is_alive()

    def _submit(self, *cmds: tuple) -> None:
        with self._lock:
            if self._stopped:
                raise EngineUnavailable("the engine has stopped")
            for cmd in cmds:
                self._commands.put(cmd)

    # -- the event loop side ---------------------------------------------------------------------
    def submit(
        self, requests: list[tuple[str, PromptType, SamplingParams]], output_kind: str = "delta"
    ) -> RequestStream:
        """Queue requests (prompts validated already) and return the stream of their outputs.

        Admission control: raises Overloaded when they would overfill the waiting queue.
        """
        if self.max_waiting_requests is not None:
            stats = self.stats
            waiting = stats.num_waiting + self._num_submitted - stats.num_added
            if waiting + len(requests) > self.max_waiting_requests:
                self.metrics.rejected += 1
                raise Overloaded(
                    f"the server is at capacity ({waiting} requests waiting, at most "
                    f"{self.max_waiting_requests}); retry later"
                )
        stream = RequestStream(self, requests, output_kind)
        self._submit(
            *[
                ("add", stream, i, rid, prompt, params, output_kind)
                for i, (rid, prompt, params) in enumerate(requests)
            ]
        )
        self._num_submitted += len(requests)
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
        if ids and not self._stopped:
            self._commands.put(("abort", ids))  # one that comes too late has nothing to abort

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` in the engine thread, between two steps, and return its result."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._submit(("call", fn, fut, loop))
        return await fut

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Abort what is in flight and stop the engine thread."""
        if self._thread.is_alive():
            self._commands.put((_STOP,))
            self._thread.join(timeout)

    # -- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        live: dict[str, tuple[RequestStream, int]] = {}  # request id -> where its outputs go
        try:
            self._loop(live)
        except BaseException:
            logger.exception("the engine thread failed")
            raise
        finally:  # nobody may wait forever: fail what is in flight or still queued
            with self._lock:
                self._stopped = True
            error = EngineUnavailable("the engine has stopped")
            self._notify_all(live, error)
            while True:
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
                if cmd[0] == "add":
                    _put_all(cmd[1].loop, [(cmd[1], cmd[2], error)])
                elif cmd[0] == "call":
                    cmd[3].call_soon_threadsafe(_set_future, cmd[2], None, error)

    def _loop(self, live: dict[str, tuple[RequestStream, int]]) -> None:
        engine = self.engine
        num_added = 0
        while True:
            try:
                cmds = [self._commands.get(block=not engine.has_unfinished_requests())]
            except queue.Empty:
                cmds = []
            while True:
                try:
                    cmds.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            stop = False
            for cmd in cmds:
                if cmd[0] is _STOP:
                    stop = True
                    continue
                num_added += cmd[0] == "add"
                self._apply(cmd, live)
            if stop:  # what is in flight is aborted; its callers hear of it in _run
                engine.abort_request(list(engine.requests))
                return
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except Exception as e:  # a bug or an impossible batch: fail its requests, live on
                    logger.exception("engine step failed; aborting %d requests", len(live))
                    self._notify_all(
                        live, EngineError(f"the engine failed: {type(e).__name__}: {e}")
                    )
                    engine.abort_request(list(engine.requests))  # frees their blocks
                    outputs = []
                self._deliver(live, outputs)
            self.stats = self._snapshot(num_added)

    def _apply(self, cmd: tuple, live: dict[str, tuple[RequestStream, int]]) -> None:
        kind = cmd[0]
        if kind == "add":
            _, stream, i, rid, prompt, params, output_kind = cmd
            try:
                self.engine.add_request(rid, prompt, params, output_kind)
            except ValueError as e:  # the input was checked before: the engine's state refused it
                _put_all(stream.loop, [(stream, i, EngineUnavailable(str(e)))])
                return
            live[rid] = (stream, i)
        elif kind == "abort":
            for rid in cmd[1]:
                live.pop(rid, None)
            self.engine.abort_request(cmd[1])
        elif kind == "call":
            _, fn, fut, loop = cmd
            try:
                result, error = fn(self.engine), None
            except Exception as e:  # noqa: BLE001 (re-raised in the caller's task)
                result, error = None, e
            loop.call_soon_threadsafe(_set_future, fut, result, error)

    def _deliver(
        self, live: dict[str, tuple[RequestStream, int]], outputs: list[RequestOutput]
    ) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for out in outputs:
            entry = live.pop(out.request_id) if out.finished else live.get(out.request_id)
            if entry is not None:
                by_loop[entry[0].loop].append((entry[0], entry[1], out))
        for loop, items in by_loop.items():
            _put_all(loop, items)

    def _notify_all(self, live: dict[str, tuple[RequestStream, int]], error: BaseException) -> None:
        """Deliver `error` to every live request's caller (they stop waiting) and forget them."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for stream, i in live.values():
            by_loop[stream.loop].append((stream, i, error))
        live.clear()
        for loop, items in by_loop.items():
            _put_all(loop, items)

    def _snapshot(self, num_added: int) -> EngineStats:
        engine, sched, bm = self.engine, self.engine.scheduler, self.engine.block_manager
        running = {s.request_id for s in sched.running}
        waiting = {s.request_id for s in sched.waiting} - running
        return EngineStats(
            num_running=len(running),
            num_waiting=len(waiting),
            num_added=num_added,
            kv_cache_usage=bm.usage,
            num_blocks=bm.num_blocks,
            prefix_queries=bm.num_prefix_queries,
            prefix_hits=bm.num_prefix_hits,
            num_preemptions=sched.num_preemptions,
            generation_tokens=engine.num_generated_tokens,
        )


def _put_all(loop: asyncio.AbstractEventLoop, items: list) -> None:
    def put() -> None:
        for stream, i, item in items:
            stream.queue.put_nowait((i, item))

    try:
        loop.call_soon_threadsafe(put)
    except RuntimeError:
        pass  # the loop is closed: nobody is waiting any more


def _set_future(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
