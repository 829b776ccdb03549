"""Sampling: seeds, determinism, top-k / top-p / min-p, penalties, stops, n."""

import pytest
import torch
from model_fixtures import assert_no_leak, make_tiny_model

from tandem import LLM, SamplingParams
from tandem.layers.sampler import apply_min_p, apply_top_k_top_p

PROMPTS = [[5, 17, 33, 8], [12, 3, 9, 9, 100], list(range(40, 60))]


@pytest.fixture(scope="module")
def llm():
    return LLM(make_tiny_model("llama"), block_size=4)


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_seeded_sampling_is_reproducible(llm):
    p = SamplingParams(temperature=1.0, max_tokens=12, seed=7, n=2, ignore_eos=True)
    a = tokens(llm.generate(PROMPTS, p, use_tqdm=False))
    b = tokens(llm.generate(PROMPTS, p, use_tqdm=False))
    c = tokens(llm.generate(PROMPTS, p.clone(seed=8), use_tqdm=False))
    assert a == b
    assert a != c
    assert a[0][0] != a[0][1]  # the n samples of one prompt differ
    assert_no_leak(llm)


def test_seeded_request_unaffected_by_batch_mates(llm):
    p = SamplingParams(temperature=1.0, max_tokens=10, seed=11, ignore_eos=True)
    alone = tokens(llm.generate([PROMPTS[0]], p, use_tqdm=False))[0]
    mates = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    mixed = llm.generate(PROMPTS, [p, mates, mates], use_tqdm=False)
    assert tokens(mixed)[0] == alone


def test_temperature_zero_is_deterministic_and_top_k_1_is_greedy(llm):
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    a = tokens(llm.generate(PROMPTS, greedy, use_tqdm=False))
    assert a == tokens(llm.generate(PROMPTS, greedy, use_tqdm=False))
    k1 = SamplingParams(temperature=1.5, top_k=1, max_tokens=10, ignore_eos=True)
    assert a == tokens(llm.generate(PROMPTS, k1, use_tqdm=False))
    p_tiny = SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=10, ignore_eos=True)
    assert a == tokens(llm.generate(PROMPTS, p_tiny, use_tqdm=False))
    minp1 = SamplingParams(temperature=1.5, min_p=1.0, max_tokens=10, ignore_eos=True)
    assert a == tokens(llm.generate(PROMPTS, minp1, use_tqdm=False))


def test_top_k_sampled_tokens_rank_within_k(llm):
    p = SamplingParams(temperature=2.0, top_k=3, max_tokens=16, logprobs=3, seed=0, ignore_eos=True)
    for out in llm.generate(PROMPTS, p, use_tqdm=False):
        c = out.outputs[0]
        for lp, t in zip(c.logprobs, c.token_ids):
            assert lp[t].rank <= 3
            assert len(lp) <= 4  # sampled token plus the top 3


def test_top_p_and_min_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = apply_top_k_top_p(logits.clone(), None, torch.tensor([0.7])).isfinite()
    assert kept.tolist() == [[True, True, False, False]]
    kept = apply_top_k_top_p(logits.clone(), torch.tensor([3]), None).isfinite()
    assert kept.tolist() == [[True, True, True, False]]
    kept = apply_min_p(logits.clone(), torch.tensor([0.5])).isfinite()
    assert kept.tolist() == [[True, True, False, False]]


def test_max_tokens_stop_tokens_min_tokens(llm):
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = llm.generate([PROMPTS[2]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    stop_tok = ref[3]
    first = ref.index(stop_tok)
    out = llm.generate([PROMPTS[2]], greedy.clone(stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_tok)
    # with min_tokens the stop token is banned until then
    out = llm.generate([PROMPTS[2]], greedy.clone(stop_token_ids=[stop_tok], min_tokens=8),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8 and stop_tok not in out.token_ids
    assert_no_leak(llm)


def test_repetition_penalty_discourages_repeats(llm):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = llm.generate([PROMPTS[1]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    pen = llm.generate([PROMPTS[1]], greedy.clone(repetition_penalty=5.0, frequency_penalty=2.0),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert len(set(pen)) > len(set(plain))


def test_stop_strings(tiny_llama_dir):
    llm = LLM(tiny_llama_dir)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full = llm.generate(["The capital of"], greedy, use_tqdm=False)[0].outputs[0]
    stop = full.text[5:8]
    assert stop
    out = llm.generate(["The capital of"], greedy.clone(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)]
    out = llm.generate(["The capital of"], greedy.clone(stop=stop, include_stop_str_in_output=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.text.endswith(stop)
    assert_no_leak(llm)


def test_min_tokens_hold_stop_strings_back(tiny_llama_dir):
    """As vLLM's (its PR 22014): a stop string counts only in text that the tokens after the first
    min_tokens added; one the first min_tokens tokens wrote does not end the sample."""
    llm = LLM(tiny_llama_dir)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = llm.generate(["The capital of"], greedy, use_tqdm=False)[0].outputs[0]
    k = 6
    head = llm.generate(["The capital of"], greedy.clone(max_tokens=k), use_tqdm=False)[0].outputs[0].text
    assert full.text.startswith(head)
    # a character both the first k tokens and a later one wrote
    stop = next(c for c in head if not c.isspace() and c in full.text[len(head):])
    early = llm.generate(["The capital of"], greedy.clone(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert early.text == full.text[: full.text.index(stop)] and len(early.text) < len(head)
    held = llm.generate(["The capital of"], greedy.clone(stop=[stop], min_tokens=k),
                        use_tqdm=False)[0].outputs[0]
    assert held.finish_reason == "stop" and held.stop_reason == stop
    assert held.text == full.text[: full.text.index(stop, len(head))]
    assert_no_leak(llm)


def test_streamed_deltas_equal_final_text_and_hold_back_stop_strings(tiny_llama_dir):
    llm = LLM(tiny_llama_dir)
    engine = llm.llm_engine
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full = llm.generate(["The capital of"], greedy, use_tqdm=False)[0].outputs[0].text
    for params in (greedy, greedy.clone(stop=[full[6:9]])):
        final = llm.generate(["The capital of"], params, use_tqdm=False)[0].outputs[0].text
        engine.add_request("s", "The capital of", params, output_kind="delta")
        pieces = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                pieces.append(out.outputs[0].text)
        assert "".join(pieces) == final
    assert_no_leak(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stream_interval_coalesces_deltas(tiny_llama_dir, async_scheduling):
    llm = LLM(tiny_llama_dir, stream_interval=4, async_scheduling=async_scheduling)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    final = llm.generate(["The capital of"], params, use_tqdm=False)[0].outputs[0]
    engine.add_request("s", "The capital of", params, output_kind="delta")
    chunks = []
    while engine.has_unfinished_requests():
        chunks += [out.outputs[0] for out in engine.step()]
    # the first token at once (TTFT is not held back), then every 4 tokens, then the rest
    assert [len(c.token_ids) for c in chunks] == [1, 4, 4, 1]
    assert sum((c.token_ids for c in chunks), []) == final.token_ids
    assert "".join(c.text for c in chunks) == final.text
    assert chunks[-1].finish_reason == "length"
    assert_no_leak(llm)


def test_stream_interval_must_be_positive():
    with pytest.raises(ValueError, match="stream_interval"):
        LLM(make_tiny_model("llama"), stream_interval=0)


def test_bad_values_are_refused():
    for kwargs in ({"temperature": float("nan")}, {"temperature": float("inf")}, {"seed": 2**64},
                   {"top_k": 2**40}):
        with pytest.raises(ValueError):
            SamplingParams(**kwargs)


def test_logit_bias(llm):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = tokens(llm.generate(PROMPTS, greedy, use_tqdm=False))
    forced = llm.generate(PROMPTS[:2], greedy.clone(logit_bias={42: 100.0}), use_tqdm=False)
    assert tokens(forced) == [[[42] * 6]] * 2
    # only the biased request changes; its neighbour in the batch keeps its greedy tokens
    banned = greedy.clone(logit_bias={t: -100.0 for t in plain[0][0]})
    mixed = llm.generate(PROMPTS[:2], [banned, greedy], use_tqdm=False)
    assert not set(mixed[0].outputs[0].token_ids) & set(plain[0][0])
    assert mixed[1].outputs[0].token_ids == plain[1][0]
    sampled = llm.generate(PROMPTS, SamplingParams(max_tokens=4, seed=0, logit_bias={7: 100.0}),
                           use_tqdm=False)
    assert tokens(sampled) == [[[7] * 4]] * 3
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(PROMPTS[:1], greedy.clone(logit_bias={10**6: 1.0}), use_tqdm=False)
