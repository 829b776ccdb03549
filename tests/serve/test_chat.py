"""/v1/chat/completions over real HTTP equals offline `LLM.chat` on the same weights."""

from __future__ import annotations

import openai
import pytest

from tandem import SamplingParams

from .helpers import MODEL_NAME

MESSAGES = [
    {"role": "system", "content": "You count."},
    {"role": "user", "content": "What is 2 + 3?"},
]


def _offline(offline, **kw):
    return offline.chat(MESSAGES, SamplingParams(**kw), use_tqdm=False)[0]


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_equals_offline(server, offline, stream):
    want = _offline(offline, temperature=0, max_tokens=20, n=2)
    body = {
        "model": MODEL_NAME,
        "messages": MESSAGES,
        "max_completion_tokens": 20,
        "max_tokens": 3,
        "temperature": 0,
        "n": 2,
        "return_token_ids": True,
    }
    if stream:  # (stream_options without stream is a 400, as in vLLM)
        body["stream_options"] = {"include_usage": True}
        events = server.stream("/v1/chat/completions", body)
        assert all(e["object"] == "chat.completion.chunk" for e in events)
        roles = [e["choices"][0] for e in events[:2]]
        assert [(c["index"], c["delta"]) for c in roles] == [
            (0, {"role": "assistant", "content": ""}),
            (1, {"role": "assistant", "content": ""}),
        ]
        assert roles[0]["prompt_token_ids"] == want.prompt_token_ids
        text, ids, finish = ["", ""], [[], []], [None, None]
        for e in events[2:-1]:
            (c,) = e["choices"]
            assert finish[c["index"]] is None, "a chunk after the finishing one"
            text[c["index"]] += c["delta"]["content"]
            ids[c["index"]] += c["token_ids"]
            finish[c["index"]] = c["finish_reason"]
        got = list(zip(text, ids, finish))
        assert events[-1]["choices"] == []
        usage = events[-1]["usage"]
    else:
        status, _, resp = server.post("/v1/chat/completions", body)
        assert status == 200, resp
        assert (
            resp["object"] == "chat.completion"
            and resp["prompt_token_ids"] == want.prompt_token_ids
        )
        assert all(c["message"]["role"] == "assistant" for c in resp["choices"])
        got = [
            (c["message"]["content"], c["token_ids"], c["finish_reason"]) for c in resp["choices"]
        ]
        usage = resp["usage"]
    assert got == [(c.text, c.token_ids, c.finish_reason) for c in want.outputs]
    assert usage["prompt_tokens"] == len(want.prompt_token_ids)
    assert usage["completion_tokens"] == sum(len(c.token_ids) for c in want.outputs)


def test_content_parts_and_logprobs(server, offline):
    want = _offline(offline, temperature=0, max_tokens=5, logprobs=3).outputs[0]
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in MESSAGES]
    status, _, resp = server.post(
        "/v1/chat/completions",
        {"messages": parts, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 3},
    )
    assert status == 200, resp
    content = resp["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    for item, entry, tok in zip(content, want.logprobs, want.token_ids):
        assert item["logprob"] == pytest.approx(entry[tok].logprob, abs=1e-4)
        assert item["bytes"] == list(item["token"].encode())
        tops = [t["logprob"] for t in item["top_logprobs"]]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert item["logprob"] <= tops[0] + 1e-6


def test_openai_client(server, offline):
    want = _offline(offline, temperature=0, max_tokens=16).outputs[0]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=16, temperature=0
    )
    assert resp.choices[0].message.content == want.text
    assert resp.choices[0].finish_reason == want.finish_reason
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=-1)
    assert e.value.body["param"] == "temperature"
    server.wait_idle()
