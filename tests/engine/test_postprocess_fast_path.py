"""The read-back's fast path for plain rows (`LLMEngine._postprocess`: fill, stop check and output
due inlined for sequences without token hooks) gives exactly what the general path gives.

The same requests run twice, the second time with every sequence sent down the general path
(`has_token_hooks` forced on), and every streamed output is compared: token ids, text, logprobs,
finish and stop reasons, in order.
"""

import pytest

from tandem import LLM, SamplingParams

KINDS = ("delta", "cumulative", "final_only")


def _requests():
    stops = list(range(40, 60))  # ~6% of the vocabulary: some samples stop early, some run out
    plain = {"temperature": 1.0, "max_tokens": 14}
    return [
        SamplingParams(seed=1, ignore_eos=True, **plain),
        SamplingParams(seed=2, stop_token_ids=stops, **plain),
        SamplingParams(seed=3, stop_token_ids=stops, min_tokens=5, **plain),
        SamplingParams(seed=4, stop_token_ids=stops, n=3, **plain),
        SamplingParams(seed=5, temperature=1.0, max_tokens=1, ignore_eos=True),
        SamplingParams(seed=6, stop_token_ids=[2], **plain),  # EOS as a stop token: no stop_reason
    ]


def _run(model_dir, async_scheduling, general_path):
    engine = LLM(model_dir, stream_interval=3, async_scheduling=async_scheduling,
                 block_size=4).llm_engine
    prompts = [list(range(3 + i, 3 + i + 5 + 3 * i)) for i in range(6)]
    for i, (prompt, params) in enumerate(zip(prompts * 3, _requests() * 3)):
        rid = f"r{i}"
        engine.add_request(rid, prompt, params, KINDS[i % 3])
        if general_path:
            for seq in engine.requests[rid].seqs:
                seq.has_token_hooks = True
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append((out.request_id, out.finished, [
                (c.index, c.token_ids, c.text, round(c.cumulative_logprob, 6), c.finish_reason, c.stop_reason)
                for c in out.outputs]))
    return seen


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_fast_path_outputs_equal_the_general_path(tiny_llama_dir, async_scheduling):
    fast = _run(tiny_llama_dir, async_scheduling, general_path=False)
    general = _run(tiny_llama_dir, async_scheduling, general_path=True)
    assert fast == general
    reasons = {c[4] for _, finished, outs in fast if finished for c in outs}
    stop_reasons = {c[5] for _, finished, outs in fast if finished for c in outs}
    assert {"stop", "length"} <= reasons  # both ends taken by the fast path
    assert any(r is not None for r in stop_reasons)
