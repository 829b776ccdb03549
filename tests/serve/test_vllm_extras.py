"""The vLLM API extras real clients use: /tokenize, /detokenize, /tokenizer_info, cached-token
usage, logit_bias, tools with tool_choice="none", null assistant content."""

from __future__ import annotations

import openai
import pytest

from .helpers import MODEL_NAME

MSG = [{"role": "user", "content": "Hello, my name is"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_tokenize_and_detokenize(server, offline):
    tok = offline.get_tokenizer()
    status, _, resp = server.post("/tokenize", {"model": MODEL_NAME, "prompt": "Hello, my name is",
                                                "return_token_strs": True})
    assert status == 200, resp
    ids = tok.encode("Hello, my name is")
    assert resp["tokens"] == ids and resp["count"] == len(ids)
    assert resp["max_model_len"] == offline.llm_engine.max_model_len
    assert resp["token_strs"] == tok.convert_ids_to_tokens(ids)
    status, _, resp = server.post("/detokenize", {"tokens": ids})
    assert status == 200 and resp == {"prompt": "Hello, my name is"}
    # messages render exactly as the chat endpoint renders them
    _, _, chat = server.post("/v1/chat/completions", {"messages": MSG, "max_tokens": 1,
                                                      "return_token_ids": True})
    _, _, resp = server.post("/tokenize", {"messages": MSG})
    assert resp["tokens"] == chat["prompt_token_ids"]
    status, _, resp = server.post("/detokenize", {"tokens": [10**6]})
    assert status == 400 and resp["error"]["param"] == "tokens"
    status, _, info = server.get("/tokenizer_info")
    assert status == 200 and info["eos_token"] == tok.eos_token and info["chat_template"]


def test_cached_tokens_in_usage(client):
    prompt = list(range(40, 90))
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    again = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < again.usage.prompt_tokens_details.cached_tokens < len(prompt)
    stream = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, stream=True,
                                       stream_options={"include_usage": True})
    *_, last = list(stream)
    assert last.usage.prompt_tokens_details.cached_tokens > 0


def test_logit_bias(client):
    resp = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=5, temperature=0.8,
                                     logit_bias={"42": 100},
                                     extra_body={"return_token_ids": True, "ignore_eos": True})
    assert resp.choices[0].model_extra["token_ids"] == [42] * 5
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MSG, max_tokens=3,
                                          logit_bias={"42": 100},
                                          extra_body={"return_token_ids": True, "ignore_eos": True})
    assert chat.choices[0].model_extra["token_ids"] == [42] * 3


def test_stream_options_need_stream(client):
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1,
                                  stream_options={"include_usage": True})


def test_tools_with_tool_choice_none_and_a_null_assistant_turn(client):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [
        *MSG,
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ]
    resp = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=tools,
                                          tool_choice="none", max_tokens=2)
    assert resp.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model=MODEL_NAME, messages=MSG, tools=tools, max_tokens=2)
