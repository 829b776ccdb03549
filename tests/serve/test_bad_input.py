"""Bad input gets a 4xx with an OpenAI error body naming the field: never a 500, never a hang."""

from __future__ import annotations

import pytest

from .helpers import MODEL_NAME

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]

CASES = [  # (path, body, status, param)
    (C, b'{"prompt": "Hello", "max_tokens": ', 400, None),  # malformed JSON
    (C, b"[1, 2, 3]", 400, None),  # not an object
    (C, b"", 400, None),
    (C, b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    (C, {"max_tokens": 3}, 400, "prompt"),
    (C, {"prompt": 5}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": [[1, 2], []]}, 400, "prompt"),
    (C, {"prompt": [1, "a"]}, 400, "prompt"),
    (C, b'{"prompt": "lone \\ud800 surrogate"}', 400, "prompt"),
    (C, {"prompt": "x", "max_tokens": "lots"}, 400, "max_tokens"),
    (C, {"prompt": "x", "stream": "maybe"}, 400, "stream"),
    (C, {"prompt": "x", "stop": 3}, 400, "stop"),
    (C, {"prompt": "x", "stop": [""]}, 400, "stop"),
    (C, {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    (C, {"prompt": "Hello " * 600}, 400, "prompt"),
    (C, {"prompt": list(range(3, 303)) * 2}, 400, "prompt"),
    (C, {"prompt": [1, 2, 10**6]}, 400, "prompt"),
    (C, {"prompt": [1, 2, -1]}, 400, "prompt"),
    (C, {"prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    (C, {"prompt": "x", "n": 10**9}, 400, "n"),
    (C, {"prompt": "x", "n": 0}, 400, "n"),
    (C, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    (C, {"prompt": "x", "top_k": -5}, 400, "top_k"),
    (C, {"prompt": "x", "min_p": 1.5}, 400, "min_p"),
    (C, {"prompt": "x", "logprobs": 99}, 400, "logprobs"),
    (C, {"prompt": "x", "seed": 2**70}, 400, "seed"),
    (C, {"prompt": "x", "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    (C, {"prompt": "x", "max_tokens": 4, "min_tokens": 9}, 400, "min_tokens"),
    (C, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (C, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    (C, {"prompt": "x", "logit_bias": {"x": 1.0}}, 400, "logit_bias"),
    (C, {"prompt": "x", "logit_bias": {"999999": 1.0}}, 400, "logit_bias"),
    (C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),  # scoring needs echo
    (C, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (C, {"prompt": "x", "best_of": 3}, 400, "best_of"),
    (C, {"prompt": "x", "stream_options": {"include_usage": "please"}}, 400, "stream_options"),
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"content": "hi"}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": "Hello " * 600}]}, 400, "messages"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, "messages"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 10**5}, 400, "max_completion_tokens"),
    (CHAT, {"messages": MSG, "top_logprobs": 30, "logprobs": True}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools"),
    (CHAT, {"messages": MSG, "model": "nope"}, 404, "model"),
]


@pytest.mark.parametrize("path,body,status,param", CASES)
def test_bad_request(server, path, body, status, param):
    got, _, resp = server.post(path, body, timeout=10)
    assert got == status, resp
    error = resp["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error


def test_unknown_route_and_method(server):
    status, _, resp = server.get("/v1/nothing")
    assert status == 404 and resp["error"]["type"] == "not_found_error"
    status, _, resp = server.get(C)
    assert status == 405 and "error" in resp


def test_server_still_serves(server):
    status, _, resp = server.post(C, {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3})
    assert status == 200 and resp["usage"]["completion_tokens"] == 3
    server.wait_idle()
