"""RequestOutput and CompletionOutput cross the engine-core process's pipe pickled (compactly,
by their `__reduce__`): what arrives must equal what was sent, field by field."""

from __future__ import annotations

import copy
import dataclasses
import multiprocessing as mp
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest

from tandem.engine.core import EngineCoreOutputs
from tandem.outputs import CompletionOutput, FlatLogprobs, Logprob, RequestOutput


def _flat() -> FlatLogprobs:
    flat = FlatLogprobs()
    flat.append({5: Logprob(-0.5, 1, "a"), 7: Logprob(-1.5, 2, None)})
    flat.append({9: Logprob(-0.1)})
    return flat


def _completion(full: bool) -> CompletionOutput:
    if not full:
        return CompletionOutput(0, "", [], None, None)
    return CompletionOutput(3, "hi there", [5, 9], -0.6, _flat(), "stop", "</s>")


def _request(full: bool) -> RequestOutput:
    if not full:
        return RequestOutput("r0", None, [], [])
    return RequestOutput(
        "r1", "a prompt", [1, 2, 3],
        [_completion(True), CompletionOutput(1, "x", [4], -1.0, [{4: Logprob(-1.0, 1, "x")}], "length")],
        finished=True, prompt_logprobs=[None, {2: Logprob(-2.0, 3, "b")}], num_cached_tokens=16,
        metrics={"arrival_time": 1.5, "first_token_time": None},
    )


CASES = [
    _completion(False), _completion(True),
    CompletionOutput(0, "a", [1], -0.1, None, "stop"),  # finish reason without a stop reason
    CompletionOutput(0, "a", [1], -0.1, None, None, 7),  # stop reason without a finish reason
    _request(False), _request(True),
    RequestOutput("r2", None, None, [_completion(False)], metrics={"arrival_time": 2.0}),  # lean
    Logprob(-0.5), Logprob(-0.5, 2, "z"), _flat(),
]


def _fields_equal(a, b) -> None:
    assert type(a) is type(b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        assert type(x) is type(y), f.name
        assert x == y, f.name


@pytest.mark.parametrize("obj", CASES, ids=lambda o: repr(o)[:60])
@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_round_trip(obj, protocol):
    back = pickle.loads(pickle.dumps(obj, protocol))
    assert back == obj and repr(back) == repr(obj)
    _fields_equal(back, obj)


@pytest.mark.parametrize("obj", CASES, ids=lambda o: repr(o)[:60])
def test_copies(obj):
    for dup in (copy.copy(obj), copy.deepcopy(obj), pickle.loads(ForkingPickler.dumps(obj))):
        assert dup == obj and repr(dup) == repr(obj)
        _fields_equal(dup, obj)
    shallow, deep = copy.copy(obj), copy.deepcopy(obj)
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        assert getattr(shallow, f.name) is v  # a shallow copy shares the fields
        if isinstance(v, (list, dict)):
            assert getattr(deep, f.name) is not v


def test_defaults_left_out_are_fresh():
    """A default left out of the pickle is made anew: two loaded outputs share no metrics dict."""
    a, b = pickle.loads(pickle.dumps([RequestOutput("a", None, [], []), RequestOutput("b", None, [], [])]))
    assert a.metrics == {} and a.metrics is not b.metrics
    c = pickle.loads(pickle.dumps(CompletionOutput(0, "", [], None, None)))
    assert c.finish_reason is None and c.stop_reason is None and not c.finished()


def test_step_outputs_cross_a_pipe():
    """A step's EngineCoreOutputs sent as the core sends it (Connection.send) arrives equal,
    and shared objects stay shared within it."""
    shared_ids = [1, 2, 3]
    outs = [RequestOutput(f"r{i}", "p", shared_ids, [_completion(bool(i % 2))], metrics={"t": float(i)})
            for i in range(50)] + [_request(True)]
    msg = EngineCoreOutputs(outputs=outs)
    r, w = mp.Pipe(duplex=False)
    w.send(msg)
    back = r.recv()
    assert back == msg
    for a, b in zip(back.outputs, msg.outputs):
        _fields_equal(a, b)
        for ca, cb in zip(a.outputs, b.outputs):
            _fields_equal(ca, cb)
    assert back.outputs[0].prompt_token_ids is back.outputs[1].prompt_token_ids


@pytest.mark.parametrize("full", [_completion(True), _request(True)], ids=["completion", "request"])
def test_reduce_carries_every_field(full):
    """A field added to the dataclass but not to its `__reduce__` would be lost on the pipe."""
    assert len(full.__reduce__()[1]) == len(dataclasses.fields(full))
