"""RequestStream: the caller's side of requests submitted together to the AsyncLLM.

The engine thread drops outputs into the stream's asyncio queue; the caller iterates
(index, RequestOutput) pairs. Latency metrics are observed here, as the server sees each output.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
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
        self._fixers = [_FinalText(llm.tokenizer, p) for _, _, p in requests]

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
                    self._fixers[i].update(item)
                if item.finished:
                    self.unfinished.discard(i)
                    metrics.observe_finished(item, now - self._t0)
                yield i, item
        finally:
            if self.unfinished:
                self.abort()


class _FinalText:
    """Completes the last text delta of each sample with what the engine's incremental
    detokenizer still holds back (the bytes of a character that never completed), so the
    streamed text equals the text of a non-streamed request. A no-op once the engine flushes."""

    def __init__(self, tokenizer, params: SamplingParams):
        self.tokenizer = tokenizer if params.detokenize else None
        self.skip_special = params.skip_special_tokens
        self.ids: dict[int, list[int]] = defaultdict(list)
        self.text: dict[int, list[str]] = defaultdict(list)
        self.done: set[int] = set()

    def update(self, out: RequestOutput) -> None:
        if self.tokenizer is None:
            return
        for c in out.outputs:
            if c.index in self.done:
                continue
            self.ids[c.index] += c.token_ids
            self.text[c.index].append(c.text)
            if c.finish_reason is None:
                continue
            self.done.add(c.index)
            if isinstance(c.stop_reason, str):
                continue  # cut at a stop string: the engine trimmed the text on purpose
            sent = "".join(self.text[c.index])
            full = self.tokenizer.decode(self.ids[c.index], skip_special_tokens=self.skip_special)
            if len(full) > len(sent) and full.startswith(sent):
                c.text += full[len(sent) :]
