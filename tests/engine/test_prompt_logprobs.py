"""Prompt logprobs (`SamplingParams(prompt_logprobs=k)`) equal an HF forward pass, whatever the
prefill looked like: one chunk, many chunks, after a prefix-cache hit, with async scheduling."""

import pytest
import torch
from model_fixtures import assert_no_leak, make_tiny_model

from tandem import LLM, SamplingParams

PROMPTS = [list(range(40, 79)), [5, 17, 33, 8, 91, 4, 60], [12, 3], [7]]


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama")


def hf_prompt_logprobs(model, prompt):
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)  # [T, V]: row p predicts token p + 1


def check(model, out, k):
    prompt = out.prompt_token_ids
    ref = hf_prompt_logprobs(model, prompt)
    plp = out.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    for p in range(1, len(prompt)):
        entry, row = plp[p], ref[p - 1]
        token = prompt[p]
        assert next(iter(entry)) == token  # the prompt token first, then its alternatives
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(k).indices.tolist()
        assert set(entry) == {token, *top}
        for t in top:
            assert entry[t].logprob == pytest.approx(row[t].item(), abs=1e-4)


@pytest.mark.parametrize("kw", [
    {},  # each prompt in one chunk
    {"max_num_batched_tokens": 16},  # chunked prefill: the 39-token prompt in three chunks
    {"max_num_batched_tokens": 16, "async_scheduling": True},
])
def test_prompt_logprobs_match_hf(model, kw):
    llm = LLM(model, block_size=4, **kw)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        check(model, out, 2)
        assert len(out.outputs[0].token_ids) == 3
    assert_no_leak(llm)


def test_a_cached_prefix_keeps_its_logprobs(model):
    llm = LLM(model, block_size=4)
    greedy = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([PROMPTS[0]], greedy, use_tqdm=False)  # the prompt's blocks are now cached
    again = llm.generate([PROMPTS[0]], greedy, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.prompt_logprobs is None
    out = llm.generate([PROMPTS[0]], greedy.clone(prompt_logprobs=1), use_tqdm=False)[0]
    check(model, out, 1)


def test_n_samples_share_one_set_of_prompt_logprobs(model):
    llm = LLM(model, block_size=4)
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4, prompt_logprobs=0)
    out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])
    check(model, out, 0)
    assert_no_leak(llm)


def test_prompt_logprobs_bounds():
    with pytest.raises(ValueError, match="prompt_logprobs must be an integer"):
        SamplingParams(prompt_logprobs=-1)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preempted_sequences_keep_whole_prompt_logprobs(model, async_scheduling):
    prompts = [list(range(i, i + 13)) for i in range(0, 60, 10)]
    # 11 blocks of 4 = 44 tokens: six 43-token sequences never fit at once; chunks of 8
    tight = LLM(model, block_size=4, num_gpu_blocks_override=11, max_model_len=44,
                max_num_batched_tokens=8, async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=1)
    for out in tight.generate(prompts, params, use_tqdm=False):
        check(model, out, 1)
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert_no_leak(tight)
