"""A request with one text prompt reaches the engine from the tokenizer's thread, as soon as its
prompt is encoded, without waiting for the event loop (which in a burst is busy reading every
other request); a client gone meanwhile has it aborted. Ordering is made deterministic by holding
threads on Events, never by sleeping."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tandem.engine.core import ADD
from tandem.serve.completions import OpenAIServingCompletion
from tandem.serve.protocol import CompletionRequest

from .helpers import MODEL_NAME

GUARD_S = 30.0  # only a hang guard: nothing passes or fails on time


class Adds(list):
    """(request id, the sending thread's name) of every request handed to the engine; `event` is
    set at each one."""

    def __init__(self):
        super().__init__()
        self.event = threading.Event()


@pytest.fixture
def adds(server, monkeypatch) -> Adds:
    core = server.llm.engine_core
    send = core.send
    record = Adds()

    def recording_send(cmds):
        new = [(c[1], threading.current_thread().name) for c in cmds if c[0] == ADD]
        record.extend(new)
        if new:
            record.event.set()
        return send(cmds)

    monkeypatch.setattr(core, "send", recording_send)
    return record


def _hold(executor) -> threading.Event:
    """The executor's one thread waits on the returned Event (work submitted meanwhile queues)."""
    release = threading.Event()
    executor.submit(release.wait, GUARD_S)
    return release


def _until(predicate, what: str) -> None:
    done = threading.Event()
    for _ in range(int(GUARD_S / 0.005)):
        if predicate():
            return
        done.wait(0.005)  # polls a state, with a guard: nothing here depends on how long it takes
    raise AssertionError(f"never: {what}")


def test_text_prompts_are_handed_over_on_the_tokenizers_thread(server, adds):
    """One text prompt (completions, chat): the tokenizer's thread sends it to the engine; token
    ids and several prompts go from the event loop as before. Every answer is a 200."""
    bodies = [
        ("/v1/completions", {"prompt": "Hello there", "max_tokens": 3}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}),
        ("/v1/completions", {"prompt": [1, 2, 3, 4], "max_tokens": 3}),
        ("/v1/completions", {"prompt": ["one", "two"], "max_tokens": 3}),
    ]
    for path, body in bodies:
        status, _, resp = server.post(path, {"model": MODEL_NAME, "temperature": 0, **body})
        assert status == 200, resp
    threads = [name for _, name in adds]
    assert len(threads) == 5, adds
    assert threads[0].startswith("tandem-tokenizer") and threads[1].startswith("tandem-tokenizer")
    assert not any(t.startswith("tandem-tokenizer") for t in threads[2:])


def test_the_engine_gets_the_request_while_the_event_loop_is_held(server, adds):
    """The prompt waits in the tokenizer's queue; the server's event loop is then held; released,
    the tokenizer's thread encodes the prompt and hands the request to the engine with the loop
    still held. Released too, the loop answers."""
    llm = server.llm
    release_tokenizer = _hold(llm._tokenizer_thread)
    result = {}

    def client():
        result["response"] = server.post(
            "/v1/completions", {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 4,
                                "temperature": 0})

    caller = threading.Thread(target=client)
    caller.start()
    loop_held, release_loop = threading.Event(), threading.Event()
    try:
        _until(lambda: len(llm._encoder._pending) == 1, "the prompt waits for the tokenizer")
        server_loop = llm._encoder._pending[0][3]
        server_loop.call_soon_threadsafe(lambda: (loop_held.set(), release_loop.wait(GUARD_S)))
        assert loop_held.wait(GUARD_S)
        release_tokenizer.set()
        assert adds.event.wait(GUARD_S), "the request did not reach the engine"
        assert loop_held.is_set() and not release_loop.is_set()  # (the loop was held throughout)
        assert adds[0][1].startswith("tandem-tokenizer")
    finally:
        release_tokenizer.set()
        release_loop.set()
        caller.join(GUARD_S)
    status, _, body = result["response"]
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 4


def test_a_caller_gone_before_its_request_is_returned_has_it_aborted(server, adds):
    """The handler's task is cancelled (its client went away) while its request is being handed
    over: the engine got it, so it is aborted there, and the engine ends idle with every KV block
    free."""
    completions = OpenAIServingCompletion(server.llm, MODEL_NAME)
    req = CompletionRequest(model=MODEL_NAME, prompt="A long story", max_tokens=200, ignore_eos=True)
    entered, go = threading.Event(), threading.Event()

    def build(ids):
        entered.set()  # the tokenizer's thread, after encoding; held until the caller is gone
        assert go.wait(GUARD_S)
        return [("handover-gone-0", {"prompt": "A long story", "prompt_token_ids": ids},
                 completions.make_params(req, ids, "max_tokens", None, "prompt"))]

    async def main():
        task = asyncio.ensure_future(
            completions.encode_and_submit("A long story", "prompt", "delta", build))
        assert await asyncio.to_thread(entered.wait, GUARD_S)
        task.cancel()
        await asyncio.sleep(0)
        go.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        # the result reaches this loop after the cancel: undone there
        await asyncio.to_thread(server.llm._tokenizer_thread.submit(lambda: None).result, GUARD_S)
        for _ in range(5):
            await asyncio.sleep(0)

    asyncio.run(main())
    assert [rid for rid, _ in adds] == ["handover-gone-0"]
    server.wait_idle()
