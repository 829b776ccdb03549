"""Hundreds of random bodies, built from the server's own OpenAPI schema: never a 5xx, never a
hang, and the server still answers (and holds no KV block) afterwards."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
TEXT = st.text(max_size=30) | st.text(max_size=10).map(lambda t: t + "\udc80")  # + lone surrogate
TOKEN_IDS = st.lists(st.integers(0, 319), min_size=1, max_size=8)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"])},
    optional={
        "content": TEXT
        | st.lists(
            st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}),
            max_size=2,
        )
    },
)
STOP = st.text(min_size=1, max_size=3)
# Mostly valid values for the fields that steer generation, so that many bodies get past
# validation and run; a field drawn from JSON instead is mostly invalid.
PLAUSIBLE = {
    "model": st.just("tiny-llama"),
    "prompt": TEXT
    | TOKEN_IDS
    | st.lists(st.text(max_size=10), max_size=3)
    | st.lists(TOKEN_IDS, max_size=3),
    "messages": st.lists(MESSAGE, min_size=1, max_size=3),
    "n": st.integers(1, 4),
    "temperature": st.floats(0, 3),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 400),
    "min_p": st.floats(0, 1),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": STOP | st.lists(STOP, max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 319), max_size=3),
    "min_tokens": st.integers(0, 3),
    "logprobs": st.integers(0, 5) | st.booleans(),
    "top_logprobs": st.integers(0, 5),
    "repetition_penalty": st.floats(0.5, 2),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
    ),
    "user": st.text(max_size=8),
    "response_format": st.just({"type": "text"}),
    **{name: st.none() for name in ("prompt_logprobs", "logit_bias", "best_of", "suffix", "tools")},
    **{
        name: st.booleans()
        for name in (
            "echo",
            "ignore_eos",
            "include_stop_str_in_output",
            "return_token_ids",
            "stream",
            "skip_special_tokens",
            "add_generation_prompt",
            "continue_final_message",
        )
    },
}
# The one guard on run time, always applied: a valid request generates a handful of tokens (an
# absent or null length would let it run to the context length).
VALID_LENGTH, BAD_LENGTH = st.integers(1, 6), st.sampled_from([0, -1, 10**9, 2**64, 2.5, "x", []])
LENGTH_FIELDS = {"max_tokens", "max_completion_tokens"}


@pytest.fixture(scope="module")
def schema_fields(server) -> dict[str, list[str]]:
    """Each endpoint's request fields, read from the server's /openapi.json."""
    status, _, spec = server.get("/openapi.json")
    assert status == 200
    fields = {}
    for path in ("/v1/completions", "/v1/chat/completions"):
        ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        model = spec["components"]["schemas"][ref["$ref"].rsplit("/", 1)[-1]]
        fields[path] = sorted(model["properties"])
    assert "prompt" in fields["/v1/completions"] and "messages" in fields["/v1/chat/completions"]
    return fields


@st.composite
def bodies(draw, fields: dict[str, list[str]]) -> tuple[str, bytes]:
    path = draw(st.sampled_from(sorted(fields)))
    if draw(st.integers(0, 19)) == 0:
        return path, draw(st.binary(max_size=40))
    body = {}
    for name in fields[path]:
        if name in LENGTH_FIELDS:
            body[name] = draw(VALID_LENGTH if draw(st.integers(0, 9)) < 9 else BAD_LENGTH)
        # (hypothesis favours 0, so 0 means the common case: field absent, value plausible)
        elif draw(st.integers(0, 9)) >= (1 if name in ("prompt", "messages") else 8):
            body[name] = draw(PLAUSIBLE.get(name, JSON) if draw(st.integers(0, 4)) < 4 else JSON)
    return path, json.dumps(body).encode()


@settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_random_bodies_never_5xx(server, schema_fields, data):
    path, body = data.draw(bodies(schema_fields))
    status, _, resp = server.post(path, body, timeout=30)
    assert status < 500, (body, resp)
    if status >= 400:
        assert set(resp["error"]) == {"message", "type", "param", "code"}, resp
    elif isinstance(resp, str):  # a stream
        assert resp.endswith("data: [DONE]\n\n") and '"error"' not in resp, resp[-500:]


def test_still_answering_after_fuzz(server):
    assert server.get("/health")[0] == 200
    status, _, resp = server.post("/v1/completions", {"prompt": "Hello", "max_tokens": 2})
    assert status == 200, resp
    server.wait_idle()
