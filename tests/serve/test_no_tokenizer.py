"""A model without a tokenizer (as a dummy-weight preset is): token-id prompts work and return
token ids with empty text; text prompts and chat get a clear 400."""

from __future__ import annotations

import pytest
from model_fixtures import make_tiny_model

from .helpers import run_server


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-no-tokenizer")
    make_tiny_model("llama").save_pretrained(d)
    with run_server(str(d)) as s:
        assert s.llm.tokenizer is None
        yield s


def test_token_ids_in_token_ids_out(bare):
    body = {
        "prompt": [5, 6, 7],
        "max_tokens": 4,
        "temperature": 0,
        "return_token_ids": True,
        "logprobs": 1,
        "ignore_eos": True,
    }
    status, _, resp = bare.post("/v1/completions", body)
    assert status == 200, resp
    (c,) = resp["choices"]
    assert c["text"] == "" and len(c["token_ids"]) == 4
    assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
    events = bare.stream("/v1/completions", body)
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == c["token_ids"]
    assert all(e["choices"][0]["text"] == "" for e in events)


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt": "Hello"}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ],
)
def test_text_needs_a_tokenizer(bare, path, body, param):
    status, _, resp = bare.post(path, body)
    assert status == 400 and resp["error"]["param"] == param
    assert resp["error"]["code"] == "no_tokenizer" and "token ids" in resp["error"]["message"]
    bare.wait_idle()
