"""RequestStream: the caller's side of requests submitted together to the AsyncLLM.

The engine thread drops outputs into the stream's asyncio queue; the caller iterates
(index, RequestOutput) pairs. Latency metrics are observed here, as the server sees each output.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.engine.llm_engine import PromptType
    from tandem.serve.async_engine import AsyncLLM


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

    def abort(self) -> None:
        self._llm.abort([self.request_ids[i] for i in self.unfinished])
        self.unfinished.clear()

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        metrics = self._llm.metrics
        try:
            while self.unfinished:
                i, item = await self.queue.get()
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
