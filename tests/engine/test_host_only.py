"""EngineConfig.host_only: the engine's host path with no forward or sampling (what `tandem bench
throughput --host-only` times). Every request gets its tokens (the fixed one) through the real
scheduler, step inputs, read-back, stop checks and outputs, in single steps and in windows, with
and without async scheduling; requests that need logits are refused with the field named."""

from __future__ import annotations

import asyncio

import pytest
from model_fixtures import assert_no_leak, make_tiny_model

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.engine.async_llm import AsyncLLM
from tandem.engine.model_runner import HOST_ONLY_TOKEN

PROMPTS = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 5, 17, 40, 9)]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("num_scheduler_steps", [1, 4])
def test_every_token_comes_back_through_the_host_path(async_scheduling, num_scheduler_steps):
    llm = LLM(make_tiny_model("llama"), host_only=True, max_num_seqs=3, block_size=4,
              async_scheduling=async_scheduling, num_scheduler_steps=num_scheduler_steps)
    lengths = [1, 7, 12, 30, 4]
    params = [SamplingParams(temperature=t, max_tokens=n, ignore_eos=True) for t, n in zip((0, 1, 0, 1, 0), lengths)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [[HOST_ONLY_TOKEN] * n for n in lengths]
    stop = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=20, stop_token_ids=[HOST_ONLY_TOKEN]),
                        use_tqdm=False)[0].outputs[0]
    assert stop.token_ids == [HOST_ONLY_TOKEN] and stop.finish_reason == "stop"  # stop checks run
    assert_no_leak(llm)


@pytest.mark.parametrize("field, value", [("logprobs", 1), ("prompt_logprobs", 0),
                                          ("structured_outputs", "regex")])
def test_requests_that_need_logits_are_refused(field, value):
    from tandem.sampling_params import StructuredOutputsParams

    if field == "structured_outputs":
        value = StructuredOutputsParams(regex="[a-z]+")
    llm = LLM(make_tiny_model("llama"), host_only=True)
    with pytest.raises(ValueError, match=f"{field}: this engine runs with host_only=True"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, **{field: value}), use_tqdm=False)
    assert llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_async_llm_refuses_them_before_they_cross(tiny_llama_dir):
    llm = AsyncLLM(EngineConfig(model=tiny_llama_dir, device="cpu", host_only=True), engine_mode="process")
    try:
        with pytest.raises(ValueError, match="logprobs: this engine runs with host_only=True"):
            llm.validate_request([3, 4], SamplingParams(logprobs=2))

        async def one():
            return [o async for o in llm.generate("r", {"prompt_token_ids": [3, 4]},
                                                  SamplingParams(max_tokens=5, ignore_eos=True))]

        outs = asyncio.run(one())
        assert sum((o.outputs[0].token_ids for o in outs), []) == [HOST_ONLY_TOKEN] * 5
    finally:
        llm.shutdown()
