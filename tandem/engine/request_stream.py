"""RequestStream: the caller's side of requests submitted together to the AsyncLLM.

The engine thread drops outputs into the stream's queue; the caller iterates (index,
RequestOutput) pairs. Deltas that pile up while the caller is busy leave as one (vLLM's output
coalescing). Latency metrics are observed here, as the server sees each output.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.engine.async_llm import AsyncLLM
    from tandem.engine.llm_engine import PromptType

Item = tuple[int, RequestOutput | BaseException]


class OutputQueue:
    """An unbounded queue with one reader, in the event loop's thread: a deque and the reader's
    future. asyncio.Queue does the same with more bookkeeping (getter and putter lists, a loop
    check per call), which a server pays on every streamed chunk."""

    def __init__(self) -> None:
        self.items: deque[Item] = deque()
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item: Item) -> None:
        self.items.append(item)
        self.wake()

    def wake(self) -> None:
        """Let the reader run (a new item, or the stream has nothing left to wait for)."""
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self) -> None:
        """Until an item is there (or `wake` is called)."""
        if not self.items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None


class RequestStream:
    """Outputs of several engine requests, in arrival order. Leaving the iteration early (an
    exception, a cancelled task, a client gone) aborts the unfinished ones, freeing their KV
    blocks; a failure in the engine raises EngineError or EngineUnavailable."""

    def __init__(
        self,
        llm: AsyncLLM,
        requests: list[tuple[str, PromptType, SamplingParams]],
        output_kind: str,
        loop: asyncio.AbstractEventLoop | None = None,
    ):
        self.loop = loop or asyncio.get_running_loop()
        self.queue = OutputQueue()
        self.request_ids = [rid for rid, _, _ in requests]
        self.output_kind = output_kind
        self.unfinished = set(range(len(requests)))
        self._llm = llm
        self._t0 = time.perf_counter()
        self._last = [0.0] * len(requests)

    def _coalesce(self, i: int, item: RequestOutput) -> RequestOutput:
        """Fold deltas of request `i` that queued up while the previous chunk was being sent into
        one: when the client side falls behind the engine, chunks grow instead of the backlog."""
        items = self.queue.items
        while not item.finished and items:
            j, nxt = items[0]
            if j != i or isinstance(nxt, BaseException):
                break
            items.popleft()
            item.add(nxt)
        return item

    def abort(self) -> None:
        """Abort the unfinished requests; an iteration waiting for their outputs ends."""
        self._llm.abort([self.request_ids[i] for i in self.unfinished])
        self.unfinished.clear()
        self.queue.wake()

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        metrics = self._llm.metrics
        items = self.queue.items
        delta = self.output_kind == "delta"
        try:
            while self.unfinished:
                if not items:
                    await self.queue.wait()
                    continue  # an output came, or an abort left nothing to wait for
                i, item = items.popleft()
                if isinstance(item, BaseException):
                    self.unfinished.discard(i)
                    raise item
                now = time.perf_counter()
                if delta:
                    item = self._coalesce(i, item)
                    if self._last[i]:
                        metrics.itl.observe(now - self._last[i])
                    else:
                        metrics.ttft.observe(now - self._t0)
                    self._last[i] = now
                if item.finished:
                    self.unfinished.discard(i)
                    metrics.observe_finished(item, now - self._t0)
                yield i, item
        finally:
            if self.unfinished:
                self.abort()
