"""Prompts encoded in batches for the API server (vLLM's AsyncMicrobatchTokenizer, without its
timer).

A fast (Rust) tokenizer's single `encode` holds the GIL for the whole text: ~0.2 ms for 128
tokens of text on a fast core, more on a server's, so a burst of requests spends most of the event
loop's time encoding prompts while the engine waits for them. Its batch call runs outside the
GIL, on as many cores as it has texts. Here the texts that arrive while a batch is being encoded
make the next batch: one text alone goes at once, a burst goes in a few calls. The batches run on
the tokenizer's one thread, beside the other tokenizer work (chat templates, decoding), since an
HF tokenizer must not be used from two threads at once.

`encode(text, then=fn)` also runs `fn(ids)` on that thread as soon as the text's batch is
encoded, and returns what it returns: an API server hands a request to the engine there. On the
event loop the caller would resume only after everything queued before it, and in a burst that is
every other request's parsing and checks: the engine waited for the whole burst to be read.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

__all__ = ["MicrobatchTokenizer"]

# one pending text: the text, the encode call's keyword arguments, where its result goes, and
# the caller's `then` and `undo` (or None)
_Item = tuple[str, tuple, asyncio.Future, asyncio.AbstractEventLoop, Callable | None, Callable | None]
# what goes back to a caller: its future and loop, the result or the error, its `undo`
_Result = tuple[asyncio.Future, asyncio.AbstractEventLoop, Any, BaseException | None, Callable | None]


class MicrobatchTokenizer:
    """`await encode(text, **kwargs)`: `tokenizer.encode(text, **kwargs)`, batched with the texts
    pending beside it. Safe from several event loops; each result is set on its caller's loop."""

    def __init__(self, tokenizer: Any, executor: Executor):
        self.tokenizer = tokenizer
        self._executor = executor
        self._lock = threading.Lock()
        self._pending: list[_Item] = []
        self._draining = False  # a drain is queued or running on the executor
        self._closed: BaseException | None = None  # set by close(): what every encode raises
        # only a fast tokenizer's batch runs outside the GIL; others encode one text at a time
        self._batched = bool(getattr(tokenizer, "is_fast", False))
        self.num_batches = 0  # batch calls made (for tests and tools)

    async def encode(self, text: str, then: Callable[[list[int]], Any] | None = None,
                     undo: Callable[[Any], None] | None = None, **kwargs: Any) -> Any:
        """The ids of `text`; with `then`, `then(ids)` run on the tokenizer's thread right after
        the batch (its exceptions are the caller's), and `undo(result)` run on the caller's loop
        if the caller was cancelled before the result reached it."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        key = tuple(sorted(kwargs.items()))
        hash(key)  # (TypeError here, for the caller, rather than in the drain)
        item = (text, key, fut, loop, then, undo)
        with self._lock:
            if self._closed is not None:
                raise self._closed
            self._pending.append(item)
            start = not self._draining
            self._draining = True
        if start:
            try:
                self._executor.submit(self._drain)
            except BaseException:  # the executor is shut down: nothing will encode it
                with self._lock:
                    self._draining = False
                    if item in self._pending:
                        self._pending.remove(item)
                raise
        return await fut

    def close(self, error: BaseException) -> None:
        """Fail every text not yet encoded with `error`, and every later encode (the server is
        shutting down: a drain queued on the executor may never run)."""
        with self._lock:
            self._closed = error
            pending, self._pending = self._pending, []
        _deliver([(fut, loop, None, error, None) for _, _, fut, loop, _, _ in pending])

    # -- the tokenizer's thread --------------------------------------------------------------------
    def _drain(self) -> None:
        while True:
            with self._lock:
                pending, self._pending = self._pending, []
                if not pending:
                    self._draining = False
                    return
            by_kwargs: dict[tuple, list[_Item]] = defaultdict(list)
            for item in pending:
                by_kwargs[item[1]].append(item)
            for key, items in by_kwargs.items():
                _deliver(self._encode_items(items, dict(key)))

    def _encode_items(self, items: list[_Item], kwargs: dict) -> list[_Result]:
        live = [item for item in items if not item[2].cancelled()]  # (a client went away)
        if self._batched and len(live) > 1:
            self.num_batches += 1
            try:
                ids = self.tokenizer([text for text, *_ in live], **kwargs)["input_ids"]
            except BaseException:  # noqa: BLE001 (a Rust panic is a BaseException)
                ids = None  # one bad text must fail alone: encode them one at a time
            if ids is not None:
                return [_then(item, list(i)) for item, i in zip(live, ids)]
        results = []
        for item in live:
            text, _, fut, loop, _, _ = item
            try:
                if self._batched:  # a batch of one runs outside the GIL too
                    self.num_batches += 1
                    ids = list(self.tokenizer([text], **kwargs)["input_ids"][0])
                else:
                    ids = self.tokenizer.encode(text, **kwargs)
            except Exception as e:  # noqa: BLE001 (the caller's error, as encode would raise it)
                results.append((fut, loop, None, e, None))
                continue
            except BaseException as e:  # noqa: BLE001 (a Rust panic): an error like any other
                results.append((fut, loop, None, RuntimeError(f"the tokenizer failed: {e!r}"), None))
                continue
            results.append(_then(item, ids))
        return results


def _then(item: _Item, ids: list[int]) -> _Result:
    """The caller's result for `ids`: `then(ids)` where it gave one (its error otherwise)."""
    _, _, fut, loop, then, undo = item
    if then is None:
        return fut, loop, ids, None, None
    try:
        return fut, loop, then(ids), None, undo
    except Exception as e:  # noqa: BLE001 (the caller's error, raised where it awaits)
        return fut, loop, None, e, None


def _deliver(results: list[_Result]) -> None:
    """Set each future's result or error on its own loop, one call a loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
    for fut, loop, value, error, undo in results:
        by_loop[loop].append((fut, value, error, undo))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_set_all, items)
        except RuntimeError:
            for _, value, error, undo in items:  # the loop is closed: nobody is waiting any more
                if undo is not None and error is None:
                    undo(value)


def _set_all(items: list) -> None:
    for fut, value, error, undo in items:
        if fut.done():  # cancelled meanwhile: what `then` did is undone
            if undo is not None and error is None:
                undo(value)
            continue
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)
