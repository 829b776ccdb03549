"""Scoring through /v1/completions as lm-eval's `local-completions` does it: `echo` + `logprobs`
return the prompt's tokens with their logprobs (equal to an HF forward pass), `max_tokens=0`
scores without generating, and vLLM's `prompt_logprobs` extra field."""

from __future__ import annotations

import openai
import pytest
import torch
import transformers

from .helpers import MODEL_NAME

PROMPT = "The capital of France is Paris. The capital of Italy is Rome."


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[T, V]: row p is the distribution of token p + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_echo_returns_prompt_logprobs_equal_to_hf(client, offline, hf):
    ids = offline.get_tokenizer().encode(PROMPT)
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, logprobs=1,
                                     echo=True, temperature=0)
    (c,) = resp.choices
    lp = c.logprobs
    assert c.text.startswith(PROMPT)
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = hf_logprobs(hf, ids)
    for p in range(1, len(ids)):
        assert lp.token_logprobs[p] == pytest.approx(ref[p - 1, ids[p]].item(), abs=1e-4)
        assert len(lp.top_logprobs[p]) in (1, 2)  # the prompt token and the most likely one
    assert lp.text_offset[0] == 0 and "".join(lp.tokens[: len(ids)]) == PROMPT
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 1


def test_streamed_echo_carries_the_prompt_in_the_first_chunk(server, offline):
    ids = offline.get_tokenizer().encode(PROMPT)
    body = {"prompt": PROMPT, "max_tokens": 3, "logprobs": 0, "echo": True, "temperature": 0}
    events = server.stream("/v1/completions", body)
    tokens = [t for e in events for c in e["choices"] for t in c["logprobs"]["tokens"]]
    first = events[0]["choices"][0]["logprobs"]
    assert len(tokens) == len(ids) + 3 and first["token_logprobs"][0] is None
    assert events[0]["choices"][0]["text"].startswith(PROMPT)


def test_max_tokens_0_scores_without_generating(client, offline, hf):
    ids = offline.get_tokenizer().encode(PROMPT)
    resp = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=0, logprobs=0,
                                     echo=True)
    (c,) = resp.choices
    assert c.text == PROMPT and len(c.logprobs.tokens) == len(ids)
    assert resp.usage.completion_tokens == 0
    ref = hf_logprobs(hf, ids)
    assert sum(c.logprobs.token_logprobs[1:]) == pytest.approx(
        sum(ref[p - 1, ids[p]].item() for p in range(1, len(ids))), abs=1e-3)
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=0)
    stream = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=0, logprobs=0,
                                       echo=True, stream=True)
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == PROMPT
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks) == len(ids)


def test_vllm_prompt_logprobs_field(server, offline, hf):
    ids = offline.get_tokenizer().encode(PROMPT)
    status, _, resp = server.post("/v1/completions", {"prompt": ids, "max_tokens": 2, "prompt_logprobs": 2})
    assert status == 200, resp
    plp = resp["choices"][0]["prompt_logprobs"]
    ref = hf_logprobs(hf, ids)
    assert len(plp) == len(ids) and plp[0] is None
    for p in range(1, len(ids)):
        entry = plp[p][str(ids[p])]
        assert entry["logprob"] == pytest.approx(ref[p - 1, ids[p]].item(), abs=1e-4)
        assert entry["rank"] == int((ref[p - 1] > ref[p - 1, ids[p]]).sum()) + 1
        assert 2 <= len(plp[p]) <= 3


def test_loglikelihood_as_lm_eval_asks_it(client, offline, hf):
    """lm-eval's loglikelihood: context + continuation token ids, max_tokens=1, logprobs=1,
    echo; the continuation's logprob is sum(token_logprobs[ctxlen:-1]). Each case's right answer
    is the model's own greedy continuation; the answers and sums must be HF's."""
    tok = offline.get_tokenizer()
    contexts = ["The capital of France is", "Hello, my name is", "What is 2 + 3? The answer is"]
    from tandem import SamplingParams

    greedy = offline.generate(contexts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                              use_tqdm=False)
    for ctx, g in zip(contexts, greedy):
        ctx_ids = tok.encode(ctx)
        choices = [g.outputs[0].token_ids, tok.encode(" Rome one"), tok.encode(" the five")]
        prompts = [ctx_ids + cont for cont in choices]
        resp = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=1, logprobs=1,
                                         echo=True, temperature=0, seed=1234)
        got, is_greedy = [], []
        for prompt, choice in zip(prompts, sorted(resp.choices, key=lambda c: c.index)):
            lp = choice.logprobs
            got.append(sum(lp.token_logprobs[len(ctx_ids) : -1]))
            is_greedy.append(all(lp.tokens[p] == max(lp.top_logprobs[p], key=lp.top_logprobs[p].get)
                                 for p in range(len(ctx_ids), len(prompt))))
        want = []
        for prompt in prompts:
            ref = hf_logprobs(hf, prompt)
            want.append(sum(ref[p - 1, prompt[p]].item() for p in range(len(ctx_ids), len(prompt))))
        assert got == pytest.approx(want, abs=1e-3)
        assert max(range(3), key=got.__getitem__) == max(range(3), key=want.__getitem__) == 0
        assert is_greedy[0]
