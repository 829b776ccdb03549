"""Structured outputs over HTTP: OpenAI's response_format (json_schema, json_object), vLLM's
structured_outputs and guided_* fields; every sampled answer validates."""

from __future__ import annotations

import json
import re

import openai
import pytest

from .helpers import MODEL_NAME

jsonschema = pytest.importorskip("jsonschema")  # a dev dependency; GPU hosts may lack it

pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "city": {"enum": ["Paris", "Rome"]},
                   "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "city", "n"],
    "additionalProperties": False,
    # llguidance's per-schema options: no free whitespace (a random tiny model would emit only that)
    "x-guidance": {"whitespace_flexible": False},
}
MSG = [{"role": "user", "content": "Where?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_response_format_json_schema(client):
    rf = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MSG, response_format=rf, n=8,
                                          temperature=1.0, seed=11, max_tokens=48)
    for c in resp.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MSG, response_format=rf,
                                            temperature=1.0, seed=12, max_tokens=48, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_vllm_structured_outputs_and_guided_fields(client):
    pattern = r"[a-c]{2}[0-9]{2}"
    resp = client.completions.create(model=MODEL_NAME, prompt="Code:", n=6, temperature=1.0, seed=1,
                                     max_tokens=16, extra_body={"structured_outputs": {"regex": pattern}})
    assert all(re.fullmatch(pattern, c.text) for c in resp.choices), [c.text for c in resp.choices]
    resp = client.completions.create(model=MODEL_NAME, prompt="Answer:", n=6, temperature=1.0, seed=2,
                                     max_tokens=16, extra_body={"guided_choice": ["yes", "no"]})
    assert {c.text for c in resp.choices} <= {"yes", "no"}
    json_object = client.chat.completions.create(
        model=MODEL_NAME, messages=MSG, max_tokens=4, response_format={"type": "json_object"})
    assert json_object.choices[0].message.content.lstrip().startswith("{")


@pytest.mark.parametrize("extra,param", [
    ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"pattern": "a"}}, "structured_outputs"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "grammar"}}, "response_format"),
    # the engine's checks name the field the constraint came in
    ({"guided_regex": "[0-9"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "nonsense"}}}}, "response_format"),
])
def test_bad_constraints_are_400s(server, extra, param):
    status, _, resp = server.post("/v1/chat/completions", {"messages": MSG, "max_tokens": 2, **extra})
    assert status == 400, resp
    assert resp["error"]["param"] == param, resp


def test_a_tokenizer_llguidance_misreads_is_a_400_and_free_requests_run(smollm2_dir, tmp_path):
    """llguidance's reading of the vocabulary would not spell what the tokenizer encodes or
    decodes, so the server refuses constrained requests with a 400 naming the tokenizer's decoder
    (before the engine sees them), and serves free ones."""
    from model_fixtures import MISREAD_DECODER, tokenizer_with_decoder

    from .helpers import run_server

    bad = tokenizer_with_decoder(smollm2_dir, tmp_path, MISREAD_DECODER, True)
    with run_server(smollm2_dir, tokenizer=bad, max_model_len=128) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        for extra in ({"structured_outputs": {"regex": "[a-z]+"}}, {"guided_choice": ["a", "b"]}):
            with pytest.raises(openai.BadRequestError) as e:
                client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=4,
                                          extra_body=extra)
            assert "llguidance reads this tokenizer" in e.value.message
            assert e.value.body["param"] == next(iter(extra))
            assert "Sequence[Replace, ByteFallback, Fuse]" in e.value.message
        free = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=4, temperature=0)
        assert free.usage.completion_tokens == 4
        # the engine never saw the constrained requests (nor built a grammar backend for them)
        assert server.call(_structured_backend) == (False, None)


def _structured_backend(engine) -> tuple[bool, str | None]:
    return engine._structured is not None, engine._structured_refusal
