"""RequestStream: the caller's side of requests submitted together to the AsyncLLM.

The engine thread drops outputs into the stream's asyncio queue; the caller iterates
(index, RequestOutput) pairs. Deltas that pile up while the caller is busy leave as one (vLLM's
output coalescing). Latency metrics are observed here, as the server sees each output.
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


class RequestStream:
    """Outputs of several engine requests, in arrival order. Leaving the iteration early (an
    exception, a cancelled task, a client gone) aborts the unfinished ones, freeing their KV
    blocks; a failure in the engine raises EngineError or EngineUnavailable."""

    def __init__(
        self,
        llm: AsyncLLM,
        requests: list[tuple[str, PromptType, SamplingParams]],
        output_kind: str,
    ):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
        self.request_ids = [rid for rid, _, _ in requests]
        self.output_kind = output_kind
        self.unfinished = set(range(len(requests)))
        self._llm = llm
        self._t0 = time.perf_counter()
        self._last = [0.0] * len(requests)

    def _coalesce(self, i: int, item: RequestOutput, held: deque) -> RequestOutput:
        """Fold deltas of request `i` that queued up while the previous chunk was being sent into
        one: when the client side falls behind the engine, chunks grow instead of the backlog."""
        while not item.finished and not self.queue.empty():
            j, nxt = self.queue.get_nowait()
            if j != i or isinstance(nxt, BaseException):
                held.append((j, nxt))
                break
            item.add(nxt)
        return item

    def abort(self) -> None:
        self._llm.abort([self.request_ids[i] for i in self.unfinished])
        self.unfinished.clear()

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        metrics = self._llm.metrics
        held: deque[tuple[int, RequestOutput | BaseException]] = deque()
        try:
            while self.unfinished:
                i, item = held.popleft() if held else await self.queue.get()
                if self.output_kind == "delta" and not isinstance(item, BaseException):
                    item = self._coalesce(i, item, held)
                if isinstance(item, BaseException):
                    self.unfinished.discard(i)
                    raise item
                now = time.perf_counter()
                if self.output_kind == "delta":
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
