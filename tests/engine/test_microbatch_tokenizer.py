"""MicrobatchTokenizer: `await encode(text, **kw)` gives exactly `tokenizer.encode(text, **kw)`;
texts that wait together go in one batch call per set of keyword arguments; a bad text fails
alone; a caller that went away, close and a shut-down executor leave nobody waiting.

Batching is made deterministic by holding the executor's one thread on an Event until every text
is pending (checked on `_pending`), never by sleeping."""

from __future__ import annotations

import asyncio
import gc
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

from tandem.engine.microbatch_tokenizer import MicrobatchTokenizer
from tests.model_fixtures import make_tokenizer

GUARD_S = 30.0  # only a hang guard: nothing passes or fails on time
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def tok():
    """The fixtures' tokenizer, plus a BOS post-processor so add_special_tokens changes the ids."""
    from tokenizers.processors import TemplateProcessing

    tok = make_tokenizer()
    bos = tok.convert_tokens_to_ids("<|endoftext|>")
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)]
    )
    assert tok.encode("hi") == [bos] + tok.encode("hi", add_special_tokens=False)
    return tok


@pytest.fixture
def executor():
    ex = ThreadPoolExecutor(1, thread_name_prefix="test-tokenizer")
    yield ex
    ex.shutdown(wait=True, cancel_futures=True)


def _idle(executor) -> None:
    """Returns once everything submitted to the executor so far has run (it has one thread): a
    drain's last look at the queue included."""
    executor.submit(lambda: None).result(GUARD_S)


@contextmanager
def _blocked(executor):
    """The executor's one thread waits on an Event until the block ends (so a drain submitted
    meanwhile queues behind it). First everything already submitted runs to its end: a drain still
    looping after its last batch would otherwise take the texts sent inside the block."""
    _idle(executor)  # (a drain needs no event loop to finish)
    release = threading.Event()
    executor.submit(release.wait, GUARD_S)
    try:
        yield
    finally:
        release.set()


async def _until_pending(mt: MicrobatchTokenizer, n: int) -> None:
    for _ in range(1000):
        if len(mt._pending) == n:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{len(mt._pending)} texts pending, expected {n}")


def _random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    alphabet = (
        list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
        + list("     \n\t.,;:!?'\"()[]{}<>|/\\-_=+*&^%$#@~`")
        + list("éèçßøåñüÆŒ") + list("中文字漢語日本語한국어") + ["😀", "🎉", "👍🏽", "🇫🇷", "\u200d"]
    )
    texts = []
    for _ in range(n):
        parts = [rng.choice(alphabet) for _ in range(rng.randint(0, 40))]
        if rng.random() < 0.3:  # a special token inside the text
            parts.insert(rng.randint(0, len(parts)), rng.choice(SPECIALS))
        texts.append("".join(parts))
    return texts + [
        "", " ", "   leading", "trailing   ", "  both  ", "<|im_start|>", "<|im_end|>\n",
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "a<|endoftext|>b",
        "The capital of France is Paris.", "中文 and English 😀 mixed",
    ]


class _Recording:
    """A fast tokenizer seen through its batch call only: records the texts of every call; raises
    for a batch holding "BAD"; can hold a call until `go` is set (once `entered` is)."""

    is_fast = True

    def __init__(self, tok, hold: bool = False):
        self.tok, self.calls = tok, []
        self.entered, self.go = threading.Event(), threading.Event()
        if not hold:
            self.go.set()

    def __call__(self, texts, **kwargs):
        self.calls.append((list(texts), kwargs))
        self.entered.set()
        assert self.go.wait(GUARD_S)
        if any("BAD" in t for t in texts):
            raise ValueError("bad text in the batch")
        return {"input_ids": self.tok(list(texts), **kwargs)["input_ids"]}

    def encode(self, text, **kwargs):
        raise AssertionError("a fast tokenizer's encode must not be used")


class _Slow:
    """A tokenizer that is not fast: encode only, one text at a time."""

    is_fast = False

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def encode(self, text, **kwargs):
        self.calls.append((text, kwargs))
        return self.tok.encode(text, **kwargs)

    def __call__(self, *args, **kwargs):
        raise AssertionError("a slow tokenizer's batch call must not be used")


def _record_loop_errors(loop) -> list:
    errors = []
    loop.set_exception_handler(lambda loop, context: errors.append(context))
    return errors


# -- results --------------------------------------------------------------------------------------
def test_results_equal_encode_for_every_text_and_kwargs(tok, executor):
    """Many texts (unicode, emoji, CJK, special tokens, empty, spaces) encoded concurrently with
    mixed kwargs in the same drains: each result is exactly tokenizer.encode's."""
    texts = _random_texts(200)
    want = [tok.encode(t) for t in texts] + [tok.encode(t, add_special_tokens=False) for t in texts]
    mt = MicrobatchTokenizer(tok, executor)

    async def main():
        calls = [mt.encode(t) for t in texts]
        calls += [mt.encode(t, add_special_tokens=False) for t in texts]
        return await asyncio.wait_for(asyncio.gather(*calls), GUARD_S)

    got = asyncio.run(main())
    assert got == want
    assert all(type(ids) is list for ids in got)
    _idle(executor)
    assert mt._pending == [] and not mt._draining


def test_a_burst_goes_in_one_batch_per_kwargs(tok, executor):
    """N texts pending together with the same kwargs: one batch call; with two kwargs sets: two."""
    texts = _random_texts(24, seed=1)
    mt = MicrobatchTokenizer(tok, executor)

    async def burst(kwargs_of):
        with _blocked(executor):
            tasks = [asyncio.ensure_future(mt.encode(t, **kwargs_of(k)))
                     for k, t in enumerate(texts)]
            await _until_pending(mt, len(texts))
        return await asyncio.wait_for(asyncio.gather(*tasks), GUARD_S)

    assert asyncio.run(burst(lambda k: {})) == [tok.encode(t) for t in texts]
    assert mt.num_batches == 1

    def mixed(k):
        return {"add_special_tokens": False} if k % 2 else {}

    got = asyncio.run(burst(mixed))
    assert got == [tok.encode(t, **mixed(k)) for k, t in enumerate(texts)]
    assert mt.num_batches == 1 + 2


def test_texts_that_arrive_during_a_batch_make_the_next_one(tok, executor):
    """While one batch is being encoded, the texts that arrive wait, then go together in the
    next batch of the same drain (no new encode needed to start it)."""
    rec = _Recording(tok, hold=True)
    mt = MicrobatchTokenizer(rec, executor)
    later = ["second", "third 😀", "<|im_start|>fourth"]

    async def main():
        first = asyncio.ensure_future(mt.encode("first"))
        assert await asyncio.to_thread(rec.entered.wait, GUARD_S)  # "first" is being encoded
        rest = [asyncio.ensure_future(mt.encode(t)) for t in later]
        await _until_pending(mt, len(later))
        rec.go.set()
        return await asyncio.wait_for(asyncio.gather(first, *rest), GUARD_S)

    assert asyncio.run(main()) == [tok.encode(t) for t in ["first"] + later]
    assert [texts for texts, _ in rec.calls] == [["first"], later]
    _idle(executor)
    assert mt._pending == [] and not mt._draining


# -- which call runs ------------------------------------------------------------------------------
def test_a_fast_tokenizer_is_called_in_batches_not_encode(tok, executor, monkeypatch):
    """For a fast tokenizer its batch call runs (even for one text): `encode` is never used."""
    texts = _random_texts(10, seed=2)
    want = [tok.encode(t) for t in texts]

    def never(*args, **kwargs):
        raise AssertionError("tokenizer.encode was called")

    monkeypatch.setattr(tok, "encode", never)
    mt = MicrobatchTokenizer(tok, executor)

    async def main():
        one = await asyncio.wait_for(mt.encode(texts[0]), GUARD_S)
        with _blocked(executor):
            tasks = [asyncio.ensure_future(mt.encode(t)) for t in texts]
            await _until_pending(mt, len(texts))
        return one, await asyncio.wait_for(asyncio.gather(*tasks), GUARD_S)

    one, got = asyncio.run(main())
    assert one == want[0] and got == want
    assert mt.num_batches == 2


def test_a_slow_tokenizer_encodes_one_text_at_a_time(tok, executor):
    """A tokenizer that is not fast: its `encode`, once per text, with the caller's kwargs."""
    slow = _Slow(tok)
    mt = MicrobatchTokenizer(slow, executor)
    texts = _random_texts(6, seed=3)

    async def main():
        with _blocked(executor):
            tasks = [asyncio.ensure_future(mt.encode(t, add_special_tokens=False)) for t in texts]
            await _until_pending(mt, len(texts))
        return await asyncio.wait_for(asyncio.gather(*tasks), GUARD_S)

    assert asyncio.run(main()) == [tok.encode(t, add_special_tokens=False) for t in texts]
    assert slow.calls == [(t, {"add_special_tokens": False}) for t in texts]
    assert mt.num_batches == 0


# -- failures -------------------------------------------------------------------------------------
async def _encode_together(mt: MicrobatchTokenizer, executor, texts: list[str]) -> list:
    """Every text pending at once (so they make one batch), then each one's ids or error."""
    with _blocked(executor):
        tasks = [asyncio.ensure_future(mt.encode(t)) for t in texts]
        await _until_pending(mt, len(texts))
    return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), GUARD_S)


def test_one_bad_text_fails_alone(tok, executor):
    """The batch call raises because of one text: that text gets the error, the others their ids."""
    rec = _Recording(tok)
    mt = MicrobatchTokenizer(rec, executor)
    texts = ["good one", "also good", "BAD text", "<|im_start|>fine", ""]

    got = asyncio.run(_encode_together(mt, executor, texts))
    assert isinstance(got[2], ValueError)
    good = [k for k in range(len(texts)) if k != 2]
    assert [got[k] for k in good] == [tok.encode(texts[k]) for k in good]
    assert rec.calls[0][0] == texts  # tried as one batch first, then one text at a time
    assert sorted(c[0][0] for c in rec.calls[1:]) == sorted(texts)


def test_a_text_the_real_tokenizer_refuses_fails_alone(tok, executor):
    """A lone surrogate makes the real tokenizer's batch call raise: only its caller sees it."""
    mt = MicrobatchTokenizer(tok, executor)
    texts = ["fine", "a\ud800b", "also fine 中文"]

    got = asyncio.run(_encode_together(mt, executor, texts))
    assert isinstance(got[1], Exception)
    assert [got[0], got[2]] == [tok.encode(texts[0]), tok.encode(texts[2])]


def test_a_cancelled_waiter_leaves_no_stray_error(tok, executor):
    """A caller cancelled while its text is pending: the others get their ids, and the loop's
    exception handler is never called (no InvalidStateError, no unretrieved exception)."""
    mt = MicrobatchTokenizer(tok, executor)
    texts = ["zero", "one", "two", "three"]

    async def main():
        errors = _record_loop_errors(asyncio.get_running_loop())
        with _blocked(executor):
            tasks = [asyncio.ensure_future(mt.encode(t)) for t in texts]
            await _until_pending(mt, len(texts))
            tasks[1].cancel()
            await asyncio.sleep(0)
            assert tasks[1].cancelled()
        return await _gather_and_settle(tasks, executor), errors

    got, errors = asyncio.run(main())
    assert isinstance(got[1], asyncio.CancelledError)
    assert [got[0], got[2], got[3]] == [tok.encode(t) for t in ("zero", "two", "three")]
    assert errors == []
    assert mt._pending == [] and not mt._draining


async def _gather_and_settle(tasks: list, executor) -> list:
    """The tasks' results (or errors); then the executor idle, the loop's callbacks run and the
    tasks collected, so that an error nobody retrieved would have reached the loop's handler."""
    got = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), GUARD_S)
    _idle(executor)
    for _ in range(5):
        await asyncio.sleep(0)
    tasks.clear()
    gc.collect()
    return got


def test_a_waiter_cancelled_during_its_batch_leaves_no_stray_error(tok, executor):
    """A caller cancelled while its batch is being encoded (its result comes back to a done
    future): the others get their ids, nothing reaches the loop's exception handler."""
    rec = _Recording(tok, hold=True)
    mt = MicrobatchTokenizer(rec, executor)
    texts = ["a", "b c", "BAD d", "e"]

    async def main():
        errors = _record_loop_errors(asyncio.get_running_loop())
        with _blocked(executor):
            tasks = [asyncio.ensure_future(mt.encode(t)) for t in texts]
            await _until_pending(mt, len(texts))
        assert await asyncio.to_thread(rec.entered.wait, GUARD_S)  # the batch is in the tokenizer
        tasks[0].cancel()
        tasks[2].cancel()  # its error would have been delivered to a cancelled future
        rec.go.set()
        return await _gather_and_settle(tasks, executor), errors

    got, errors = asyncio.run(main())
    assert isinstance(got[0], asyncio.CancelledError) and isinstance(got[2], asyncio.CancelledError)
    assert [got[1], got[3]] == [tok.encode("b c"), tok.encode("e")]
    assert errors == []


def test_close_fails_the_waiting_texts_and_every_later_one(tok, executor):
    """close(error): every pending caller raises it; the drain queued for them finds nothing and
    ends; a later encode raises it at once."""
    mt = MicrobatchTokenizer(tok, executor)

    async def main():
        with _blocked(executor):
            tasks = [asyncio.ensure_future(mt.encode(t)) for t in ("x", "y", "z")]
            await _until_pending(mt, 3)
            mt.close(RuntimeError("x"))
            for task in tasks:
                with pytest.raises(RuntimeError, match="^x$"):
                    await asyncio.wait_for(task, GUARD_S)
            assert mt._pending == []
        _idle(executor)
        assert not mt._draining
        with pytest.raises(RuntimeError, match="^x$"):
            await asyncio.wait_for(mt.encode("after"), GUARD_S)

    asyncio.run(main())


def test_unhashable_kwargs_fail_at_once_and_the_next_encode_works(tok, executor):
    """A keyword argument that cannot be grouped on fails its caller, not the drain."""
    mt = MicrobatchTokenizer(tok, executor)

    async def main():
        with pytest.raises(TypeError):
            await asyncio.wait_for(mt.encode("a", add_special_tokens=[False]), GUARD_S)
        assert mt._pending == [] and not mt._draining
        return await asyncio.wait_for(mt.encode("b"), GUARD_S)

    assert asyncio.run(main()) == tok.encode("b")


class _Panic(BaseException):
    """What a Rust panic reaches Python as (pyo3's PanicException is a BaseException)."""


def test_a_tokenizer_panic_fails_its_text_and_the_drain_goes_on(tok, executor):
    """A BaseException from the tokenizer fails that text alone (as a RuntimeError naming it); the
    others get their ids and later encodes work."""

    class Panicky:
        is_fast = True

        def __call__(self, texts, **kwargs):
            if any("PANIC" in t for t in texts):
                raise _Panic("called `Option::unwrap()` on a `None` value")
            return tok(texts, **kwargs)

    mt = MicrobatchTokenizer(Panicky(), executor)

    async def main():
        got = await _encode_together(mt, executor, ["a b", "PANIC", "c"])
        return got, await asyncio.wait_for(mt.encode("d"), GUARD_S)

    got, after = asyncio.run(main())
    assert got[0] == tok.encode("a b") and got[2] == tok.encode("c")
    assert isinstance(got[1], RuntimeError) and "unwrap" in str(got[1])
    assert after == tok.encode("d")


# -- loops and shutdown ---------------------------------------------------------------------------
def test_two_event_loops_share_one_microbatch_tokenizer(tok, executor):
    """Texts from two threads, each with its own event loop, in one batch: each gets its ids on
    its own loop."""
    mt = MicrobatchTokenizer(tok, executor)
    texts = {0: _random_texts(15, seed=10), 1: _random_texts(15, seed=11)}
    want = {k: [tok.encode(t) for t in ts] for k, ts in texts.items()}
    got, failed = {}, []

    def run(k):
        async def main():
            calls = [mt.encode(t) for t in texts[k]]
            return await asyncio.wait_for(asyncio.gather(*calls), GUARD_S)
        try:
            got[k] = asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 - reported below
            failed.append(e)

    n = sum(len(ts) for ts in texts.values())
    with _blocked(executor):
        threads = [threading.Thread(target=run, args=(k,)) for k in texts]
        for t in threads:
            t.start()
        deadline = time.monotonic() + GUARD_S  # a hang guard, not a pass/fail condition
        while len(mt._pending) < n and time.monotonic() < deadline and not failed:
            time.sleep(0.001)
        assert len(mt._pending) == n, failed
    for t in threads:
        t.join(GUARD_S)
    assert not failed and got == want
    assert mt.num_batches == 1  # one batch, its results delivered to two loops


def test_encode_after_the_executor_shut_down_raises_at_once(tok, executor):
    """With the executor shut down, encode raises RuntimeError and leaves nothing pending."""
    mt = MicrobatchTokenizer(tok, executor)
    executor.shutdown(wait=True)

    async def main():
        with pytest.raises(RuntimeError):
            await asyncio.wait_for(mt.encode("late"), GUARD_S)

    asyncio.run(main())
    assert mt._pending == [] and not mt._draining


def test_encode_after_close_with_a_queued_drain_raises(tok, executor):
    """AsyncLLM.shutdown's order: the executor shut down with cancel_futures while a drain is
    queued (it never runs), then close. A later encode raises; nobody waits forever."""
    mt = MicrobatchTokenizer(tok, executor)

    async def main():
        with _blocked(executor):
            task = asyncio.ensure_future(mt.encode("queued"))
            await _until_pending(mt, 1)
            executor.shutdown(wait=False, cancel_futures=True)
            mt.close(RuntimeError("shutting down"))
            with pytest.raises(RuntimeError, match="shutting down"):
                await asyncio.wait_for(task, GUARD_S)
        with pytest.raises(RuntimeError, match="shutting down"):
            await asyncio.wait_for(mt.encode("late"), GUARD_S)

    asyncio.run(main())


# -- through AsyncLLM -----------------------------------------------------------------------------
def test_async_llm_encode_equals_its_tokenizer(tiny_llama_dir):
    """AsyncLLM.encode (thread engine mode) gives its tokenizer's ids for texts encoded
    concurrently; shutdown fails the texts still waiting."""
    from tandem.config import EngineConfig
    from tandem.engine.async_llm import AsyncLLM, EngineUnavailable

    config = EngineConfig(model=tiny_llama_dir, device="cpu", max_num_seqs=8)
    llm = AsyncLLM(config, engine_mode="thread")
    texts = _random_texts(20, seed=20)
    stopped = False
    try:
        want = [llm.tokenizer.encode(t) for t in texts] + [
            llm.tokenizer.encode(t, add_special_tokens=False) for t in texts]

        async def main():
            nonlocal stopped
            calls = [llm.encode(t) for t in texts]
            calls += [llm.encode(t, add_special_tokens=False) for t in texts]
            got = await asyncio.wait_for(asyncio.gather(*calls), GUARD_S)
            with _blocked(llm._tokenizer_thread):
                task = asyncio.ensure_future(llm.encode("waiting"))
                await _until_pending(llm._encoder, 1)
                await asyncio.to_thread(llm.shutdown)
                stopped = True
                with pytest.raises(EngineUnavailable):
                    await asyncio.wait_for(task, GUARD_S)
            return got

        assert asyncio.run(main()) == want
    finally:
        if not stopped:
            llm.shutdown()


def test_then_runs_on_the_tokenizers_thread_after_the_batch_and_its_result_is_returned(tok, executor):
    """`encode(text, then=fn)`: fn(ids) runs on the executor's thread, once the batch the text
    went in is encoded (every text of the burst has its ids by then), before any caller resumes;
    the caller gets what fn returns, and a text without `then` its ids as before."""
    mt = MicrobatchTokenizer(tok, executor)
    texts = ["zero", "one two", "three"]
    calls = []  # (thread name, ids, callers resumed so far)
    resumed = []

    def then(ids):
        calls.append((threading.current_thread().name, ids, len(resumed)))
        return ("handed over", ids)

    async def one(i, text):
        got = await mt.encode(text, then=then if i != 1 else None)
        resumed.append(i)
        return got

    async def main():
        with _blocked(executor):
            tasks = [asyncio.ensure_future(one(i, t)) for i, t in enumerate(texts)]
            await _until_pending(mt, len(texts))
        return await _gather_and_settle(tasks, executor)

    got = asyncio.run(main())
    ids = [tok.encode(t) for t in texts]
    assert got == [("handed over", ids[0]), ids[1], ("handed over", ids[2])]
    assert [c[1] for c in calls] == [ids[0], ids[2]]
    assert all(name.startswith("test-tokenizer") for name, _, _ in calls)
    assert all(n == 0 for _, _, n in calls)  # both ran before any caller resumed
    assert mt.num_batches == 1


def test_an_error_in_then_is_its_callers_alone(tok, executor):
    """An exception `then` raises reaches its caller as encode's; the batch's other callers get
    their results; nothing is undone for the failed one."""
    mt = MicrobatchTokenizer(tok, executor)
    undone = []

    def then(ids):
        if len(ids) > 5:
            raise ValueError(f"{len(ids)} tokens")
        return ids

    async def main():
        errors = _record_loop_errors(asyncio.get_running_loop())
        with _blocked(executor):
            tasks = [asyncio.ensure_future(mt.encode(t, then=then, undo=undone.append))
                     for t in ("a", "one two three", "b")]
            await _until_pending(mt, 3)
        return await _gather_and_settle(tasks, executor), errors

    got, errors = asyncio.run(main())
    assert got[0] == tok.encode("a") and got[2] == tok.encode("b")
    assert isinstance(got[1], ValueError) and "tokens" in str(got[1])
    assert undone == [] and errors == []


def test_a_caller_cancelled_after_then_ran_has_it_undone(tok, executor):
    """A caller that goes away while `then` runs (what it did, e.g. a request handed to the
    engine, cannot be taken back there): `undo(result)` runs on the caller's loop instead of the
    result being set; a caller cancelled before its batch never runs `then` at all."""
    mt = MicrobatchTokenizer(tok, executor)
    entered, go = threading.Event(), threading.Event()
    ran, undone = [], []

    def then(ids):
        ran.append(ids)
        if len(ran) == 1:  # the first caller's then: held until the test cancels that caller
            entered.set()
            assert go.wait(GUARD_S)
        return ("result", ids)

    def undo(result):
        undone.append((threading.current_thread().name, result))

    async def main():
        errors = _record_loop_errors(asyncio.get_running_loop())
        with _blocked(executor):
            tasks = [asyncio.ensure_future(mt.encode(t, then=then, undo=undo))
                     for t in ("first", "second", "third")]
            await _until_pending(mt, 3)
            tasks[2].cancel()  # before its batch: `then` never runs for it
            await asyncio.sleep(0)
        assert await asyncio.to_thread(entered.wait, GUARD_S)
        tasks[0].cancel()
        await asyncio.sleep(0)
        go.set()
        return await _gather_and_settle(tasks, executor), errors

    got, errors = asyncio.run(main())
    assert isinstance(got[0], asyncio.CancelledError) and isinstance(got[2], asyncio.CancelledError)
    assert got[1] == ("result", tok.encode("second"))
    assert ran == [tok.encode("first"), tok.encode("second")]
    assert undone == [("MainThread", ("result", tok.encode("first")))]
    assert errors == []
