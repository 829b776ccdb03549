"""Async scheduling launches step k before step k-1's tokens are read; outputs must not change.

Every test runs the same work with `async_scheduling=False` and `True` and compares everything a
user sees: token ids, logprobs, text, finish reasons. On the CPU the pipeline is the same code as on
a GPU (placeholders, device-side gather of the previous step's tokens, one-step-late read-back);
only the overlap itself needs the GPU.
"""

import pytest
from model_fixtures import assert_no_leak, make_tiny_model

from tandem import LLM, SamplingParams
from tandem.engine import llm_engine as llm_engine_module


def _summary(outputs):
    return [
        [(c.token_ids, [round(x, 5) for x in _lps(c)], c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
        for o in outputs
    ]


def _lps(c):
    return [next(iter(d.values())).logprob for d in c.logprobs] if c.logprobs else []


def _both(model, prompts, params, **kw):
    res = []
    for mode in (False, True):
        llm = LLM(model, async_scheduling=mode, **kw)
        res.append(_summary(llm.generate(prompts, params, use_tqdm=False)))
        assert_no_leak(llm)
    return res


PROMPTS = [list(range(3, 3 + k)) for k in (5, 17, 9, 30, 2)]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=3, n=3, max_tokens=10, logprobs=2),
    SamplingParams(temperature=1.0, seed=7, max_tokens=9, repetition_penalty=1.3, presence_penalty=0.5,
                   frequency_penalty=0.2, min_tokens=4),
], ids=["greedy", "seeded-n3-logprobs", "penalties-min-tokens"])
def test_async_equals_sync(params):
    sync, async_ = _both(make_tiny_model("qwen2"), PROMPTS, params, block_size=4)
    assert async_ == sync


def test_async_with_stop_tokens_that_end_sequences_mid_batch():
    model = make_tiny_model("llama")
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref = LLM(model).generate(PROMPTS, greedy, use_tqdm=False)
    # stop on tokens each prompt actually produces, so sequences end at different steps while the
    # next step (launched before the stop is seen) already ran them
    stops = sorted({o.outputs[0].token_ids[k] for o, k in zip(ref, (2, 5, 7, 11, 3))})
    params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=stops)
    sync, async_ = _both(model, PROMPTS, params)
    assert async_ == sync
    assert any(len(o[0][0]) < 20 for o in sync)


def test_async_under_preemption_and_prefix_sharing():
    model = make_tiny_model("llama")
    prompts = [list(range(5, 18))] * 3 + [list(range(i, i + 13)) for i in range(20, 50, 10)]
    params = SamplingParams(temperature=0.9, max_tokens=25, seed=5, n=2, ignore_eos=True)
    sync, async_ = _both(model, prompts, params, block_size=4, num_gpu_blocks_override=14, max_model_len=48)
    assert async_ == sync


def test_async_stop_strings_and_text(tiny_llama_dir):
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    full = LLM(tiny_llama_dir).generate(["The capital of"], greedy, use_tqdm=False)[0].outputs[0].text
    params = greedy.clone(stop=[full[6:9]])
    sync, async_ = _both(tiny_llama_dir, ["The capital of", "Hello"], params)
    assert async_ == sync
    assert sync[0][0][3] == "stop"


def test_the_next_step_launches_before_the_previous_tokens_are_read(monkeypatch):
    llm = LLM(make_tiny_model("llama"), async_scheduling=True, num_scheduler_steps=1)  # one token a launch
    engine = llm.llm_engine
    events = []
    run = engine.worker.model_runner.run
    monkeypatch.setattr(engine.worker.model_runner, "run", lambda *a: events.append("launch") or run(*a))
    get = llm_engine_module.AsyncSamplerOutput.get
    monkeypatch.setattr(llm_engine_module.AsyncSamplerOutput, "get", lambda self: events.append("read") or get(self))
    engine.add_request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert engine.step() == []  # the first step's tokens are still "on the device"
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert events[:5] == ["launch", "launch", "read", "launch", "read"]
    assert len(outs[-1].outputs[0].token_ids) == 4 and outs[-1].finished
    assert_no_leak(llm)


def test_abort_while_a_step_is_in_flight():
    model = make_tiny_model("llama")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = LLM(model, async_scheduling=False).generate([[4, 5, 6]], params, use_tqdm=False)[0]
    llm = LLM(model, async_scheduling=True)
    engine = llm.llm_engine
    engine.add_request("keep", [4, 5, 6], params)
    engine.add_request("drop", [7, 8, 9, 10], params)
    for _ in range(3):
        engine.step()
    assert engine._in_flight is not None
    engine.abort_request("drop")
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "keep"
            finals[out.request_id] = out
    assert finals["keep"].outputs[0].token_ids == ref.outputs[0].token_ids
    assert_no_leak(llm)


def test_sleep_drains_the_in_flight_step():
    llm = LLM(make_tiny_model("llama"), async_scheduling=True, enable_sleep_mode=True)
    engine = llm.llm_engine
    engine.add_request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    llm.sleep(level=1)
    assert engine._in_flight is None
    llm.wake_up()
    assert llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert_no_leak(llm)


def test_token_ids_hold_real_ids_only_while_a_step_is_in_flight():
    """The token being sampled counts in num_tokens (a placeholder), never in token_ids."""
    llm = LLM(make_tiny_model("llama"), async_scheduling=True)
    engine = llm.llm_engine
    engine.add_request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    seen = 0
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.requests.get("r").seqs if "r" in engine.requests else []:
            assert all(t >= 0 for t in seq.token_ids)
            assert seq.num_tokens == len(seq.token_ids) + seq.num_placeholders
            seen += seq.num_placeholders
    assert seen > 0  # a step was in flight at some point
    assert_no_leak(llm)
