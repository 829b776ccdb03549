"""The generation routes' direct path (`tandem.serve.app._direct_route`) answers every request as
FastAPI's routes for them do: the same status and body for bad JSON, bytes that are not UTF-8, a
missing or non-object body, bad fields, other content types; the same completion for a good one.
Both apps are served over real HTTP on 127.0.0.1, on the same engine."""

from __future__ import annotations

import pytest

from tandem.serve.app import build_app

from .helpers import MODEL_NAME, serve_app

JSON = {"Content-Type": "application/json"}
CASES = [  # (path, body bytes, headers)
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "Hello", ', JSON),
    ("/v1/completions", b"\x80\x81 not utf-8", JSON),
    ("/v1/completions", b"", JSON),
    ("/v1/completions", b"[1, 2, 3]", JSON),
    ("/v1/completions", b'"just a string"', JSON),
    ("/v1/completions", b'{"model": "tiny-llama"}', JSON),
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "Hi", "max_tokens": "abc"}', JSON),
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "Hi", "max_tokens": -3}', JSON),
    ("/v1/completions", b'{"model": "nope", "prompt": "Hi", "max_tokens": 2}', JSON),
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "Hi", "max_tokens": 1, "temperature": 0}', {}),
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "Hi", "max_tokens": 1, "temperature": 0}',
     {"Content-Type": "text/plain"}),
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "Hi", "max_tokens": 1, "temperature": 0}',
     {"Content-Type": "application/vnd.api+json; charset=utf-8"}),
    ("/v1/chat/completions", b'{"model": "tiny-llama", "messages": "hi"}', JSON),
    ("/v1/chat/completions", b'{"model": "tiny-llama", "messages": [{"role": "user"}], "max_tokens": 2, '
                             b'"temperature": 0}', JSON),
    ("/v1/chat/completions", b'{"model": "tiny-llama", "messages": [], "n": 0}', JSON),
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "Hello", "max_tokens": 3, "temperature": 0}', JSON),
    ("/v1/chat/completions", b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], '
                             b'"max_tokens": 3, "temperature": 0}', JSON),
]


def _comparable(body):
    """A response body without what differs between two answers to one request (ids, times, the
    prefix cache's hits: the second answer finds the first's blocks)."""
    if isinstance(body, dict):
        return {k: _comparable(v) for k, v in body.items()
                if k not in ("id", "created", "prompt_tokens_details")}
    if isinstance(body, list):
        return [_comparable(v) for v in body]
    return body


@pytest.fixture(scope="module")
def fastapi_only(server):
    """The same app on the same engine with the direct routes taken out: FastAPI's own."""
    app = build_app(server.llm, MODEL_NAME)
    direct = [r for r in app.router.routes if getattr(r, "endpoint", None) is not None
              and r.endpoint.__qualname__ == "_direct_route.<locals>.endpoint"]
    assert len(direct) == 2
    app.router.routes[:] = [r for r in app.router.routes if r not in direct]
    with serve_app(app, server.llm) as s:
        yield s


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_direct_routes_answer_as_fastapi_does(server, fastapi_only, case):
    path, body, headers = CASES[case]
    got = server.request("POST", path, body, headers, 60.0)
    want = fastapi_only.request("POST", path, body, headers, 60.0)
    assert got[0] == want[0], (got[2], want[2])
    assert _comparable(got[2]) == _comparable(want[2])
