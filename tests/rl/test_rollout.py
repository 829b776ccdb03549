"""A rollout asks the engine for no text and decodes the completions in one batch at the end:
the same texts and logprobs as the engine's own detokenized outputs."""

import pytest

from tandem import LLM, SamplingParams
from tandem.rl.data import PromptBatch
from tandem.rl.rollout import generate_rollout


@pytest.mark.parametrize("stop", [None, ["e"]])
def test_rollout_texts_and_logprobs_equal_the_engines(make_llama, tiny_tokenizer, stop):
    llm = LLM(make_llama(vocab_size=len(tiny_tokenizer)), tokenizer=tiny_tokenizer, block_size=4)
    prompts = [tiny_tokenizer.encode("hello"), tiny_tokenizer.encode("abcd")]
    batch = PromptBatch(list(range(2)), prompts, [""] * 2, prompts, {})
    params = SamplingParams(temperature=1.0, max_tokens=12, stop=stop)
    r = generate_rollout(llm, batch, 3, params, seed=7)
    # what the rollout asks, but with the engine's own text
    asked = [params.clone(n=3, logprobs=0, seed=7 + i * 3) for i in range(2)]
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], asked, use_tqdm=False)
    ref = [c for o in outs for c in o.outputs]
    assert r.completion_ids == [c.token_ids for c in ref]
    assert r.texts == [c.text for c in ref] and any(r.texts)
    assert r.engine_logps == [[lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)] for c in ref]
    assert r.truncated == [c.finish_reason == "length" for c in ref]
