"""/v1/completions over real HTTP equals offline `LLM.generate` on the same weights."""

from __future__ import annotations

import openai
import pytest

from tandem import SamplingParams

from .helpers import MODEL_NAME

PROMPTS = ["Hello, my name is", "The capital of France is"]


def _offline(offline, prompts, **kw):
    return offline.generate(prompts, SamplingParams(**kw), use_tqdm=False)


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_equals_offline(server, offline, stream):
    want = _offline(offline, PROMPTS, temperature=0, max_tokens=24)
    body = {
        "model": MODEL_NAME,
        "prompt": PROMPTS,
        "max_tokens": 24,
        "temperature": 0,
        "return_token_ids": True,
    }
    if stream:  # (stream_options without stream is a 400, as in vLLM)
        body["stream_options"] = {"include_usage": True}
        events = server.stream("/v1/completions", body)
        usage = events[-1]
        assert usage["choices"] == [] and usage["object"] == "text_completion"
        text, ids, finish = {}, {}, {}
        for e in events[:-1]:
            (c,) = e["choices"]
            assert c["index"] not in finish, "a chunk after the finishing one"
            text[c["index"]] = text.get(c["index"], "") + c["text"]
            ids[c["index"]] = ids.get(c["index"], []) + c["token_ids"]
            if c["finish_reason"]:
                finish[c["index"]] = c["finish_reason"]
        got = [(text[i], ids[i], finish[i]) for i in range(len(PROMPTS))]
        usage = usage["usage"]
    else:
        status, _, resp = server.post("/v1/completions", body)
        assert status == 200, resp
        assert resp["object"] == "text_completion" and resp["model"] == MODEL_NAME
        got = [(c["text"], c["token_ids"], c["finish_reason"]) for c in resp["choices"]]
        assert [c["prompt_token_ids"] for c in resp["choices"]] == [
            w.prompt_token_ids for w in want
        ]
        usage = resp["usage"]
    assert got == [
        (w.outputs[0].text, w.outputs[0].token_ids, w.outputs[0].finish_reason) for w in want
    ]
    assert usage["prompt_tokens"] == sum(len(w.prompt_token_ids) for w in want)
    assert usage["completion_tokens"] == sum(len(w.outputs[0].token_ids) for w in want)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_token_id_prompts(server, offline):
    ids = offline.get_tokenizer().encode(PROMPTS[1])
    want = _offline(offline, [ids], temperature=0, max_tokens=10)[0].outputs[0]
    for prompt in (ids, [ids, ids]):
        status, _, resp = server.post(
            "/v1/completions",
            {"prompt": prompt, "max_tokens": 10, "temperature": 0, "return_token_ids": True},
        )
        assert status == 200, resp
        assert all(
            c["token_ids"] == want.token_ids and c["text"] == want.text for c in resp["choices"]
        )


def test_n_samples_seeded_equal_offline(server, offline):
    want = _offline(offline, PROMPTS, n=3, temperature=1.0, seed=7, max_tokens=8)
    body = {
        "prompt": PROMPTS,
        "n": 3,
        "temperature": 1.0,
        "seed": 7,
        "max_tokens": 8,
        "return_token_ids": True,
    }
    status, _, resp = server.post("/v1/completions", body)
    assert status == 200, resp
    assert [c["index"] for c in resp["choices"]] == list(range(6))
    assert [c["token_ids"] for c in resp["choices"]] == [
        c.token_ids for w in want for c in w.outputs
    ]
    events = server.stream("/v1/completions", body)
    streamed: dict[int, list[int]] = {}
    for e in events:
        for c in e["choices"]:
            streamed[c["index"]] = streamed.get(c["index"], []) + c["token_ids"]
    assert [streamed[i] for i in range(6)] == [c["token_ids"] for c in resp["choices"]]


def test_logprobs(server, offline):
    want = _offline(offline, PROMPTS[:1], temperature=0, max_tokens=6, logprobs=2)[0].outputs[0]
    status, _, resp = server.post(
        "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "logprobs": 2}
    )
    assert status == 200, resp
    lp = resp["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    for got, entry, tok in zip(lp["token_logprobs"], want.logprobs, want.token_ids):
        assert got == pytest.approx(entry[tok].logprob, abs=1e-4)
    assert all(1 <= len(top) <= 3 for top in lp["top_logprobs"])


def _stop_body(offline) -> tuple[dict, str, str]:
    """A request whose greedy output meets a two-character stop string, and the expected text."""
    full = _offline(offline, PROMPTS[:1], temperature=0, max_tokens=16)[0].outputs[0].text
    stop = next(full[i : i + 2] for i in range(3, len(full) - 2) if "\ufffd" not in full[i : i + 2])
    body = {"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0, "stop": [stop], "echo": True}
    return body, stop, PROMPTS[0] + full[: full.index(stop)]


def test_stop_string_and_echo(server, offline):
    body, stop, want = _stop_body(offline)
    status, _, resp = server.post("/v1/completions", body)
    assert status == 200, resp
    c = resp["choices"][0]
    assert (c["finish_reason"], c["stop_reason"], c["text"]) == ("stop", stop, want)


def test_stop_string_streamed(server, offline):
    body, stop, want = _stop_body(offline)
    events = server.stream("/v1/completions", body)
    assert events[-1]["choices"][0]["stop_reason"] == stop
    assert "".join(e["choices"][0]["text"] for e in events) == want


def test_openai_client(server, offline):
    want = _offline(offline, PROMPTS[:1], temperature=0, max_tokens=12)[0].outputs[0]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    (model,) = client.models.list().data
    assert model.id == MODEL_NAME
    resp = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0
    )
    assert resp.choices[0].text == want.text
    assert resp.usage.completion_tokens == len(want.token_ids)
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPTS[0],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    server.wait_idle()
