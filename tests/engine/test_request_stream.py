"""RequestStream folds deltas that queued up while the caller was busy into one output."""

import asyncio

import pytest

from tandem.engine.metrics import ServerMetrics
from tandem.engine.request_stream import RequestStream
from tandem.outputs import CompletionOutput, RequestOutput


class _FakeLLM:
    def __init__(self):
        self.metrics = ServerMetrics()
        self.aborted = []

    def abort(self, ids):
        self.aborted += ids


def _delta(tokens, text, finished=False, logprob=-1.0):
    c = CompletionOutput(index=0, text=text, token_ids=list(tokens), cumulative_logprob=logprob,
                         logprobs=None, finish_reason="length" if finished else None)
    return RequestOutput("r", None, [1, 2], [c], finished=finished)


def _collect(items, n_requests=1):
    async def go():
        llm = _FakeLLM()
        stream = RequestStream(llm, [(f"r{k}", [1], None) for k in range(n_requests)], "delta")
        for it in items:  # all queued before the caller reads: as when it fell behind
            stream.queue.put_nowait(it)
        got = []
        try:
            async for i, out in stream:
                got.append((i, out))
        except RuntimeError as e:
            got.append(("raised", str(e)))
        return got, llm
    return asyncio.run(go())


def test_queued_deltas_leave_as_one_output():
    got, llm = _collect([(0, _delta([5], "a")), (0, _delta([6, 7], "bc", logprob=-2.0)),
                         (0, _delta([8], "d", finished=True, logprob=-3.0))])
    assert len(got) == 1
    out = got[0][1].outputs[0]
    assert (out.token_ids, out.text, out.cumulative_logprob, out.finish_reason) == ([5, 6, 7, 8], "abcd", -3.0, "length")
    assert got[0][1].finished and llm.aborted == []


def test_other_requests_and_errors_are_not_folded_in():
    got, llm = _collect([(0, _delta([5], "a")), (1, _delta([9], "z", finished=True)),
                         (0, _delta([6], "b")), (0, RuntimeError("engine died"))], n_requests=2)
    assert [(i, o.outputs[0].token_ids) for i, o in got[:3]] == [(0, [5]), (1, [9]), (0, [6])]
    assert got[3] == ("raised", "engine died")
    assert llm.aborted == []  # the failed request is gone already; nothing left to abort


@pytest.mark.parametrize("n", [1, 2])
def test_request_output_add_appends_every_sample(n):
    a = RequestOutput("r", None, [1], [CompletionOutput(k, "x", [k], -1.0, None) for k in range(n)])
    b = RequestOutput("r", None, [1], [CompletionOutput(k, "y", [k + 10], -2.0, None, "stop") for k in range(n)],
                      finished=True)
    a.add(b)
    assert [(c.text, c.token_ids, c.finish_reason) for c in a.outputs] == [("xy", [k, k + 10], "stop") for k in range(n)]
    assert a.finished
