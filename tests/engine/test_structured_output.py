"""Structured outputs (`SamplingParams(structured_outputs=...)`): every sampled completion, over
many seeds, matches its JSON schema, regex or choice; greedy or sampled, batched with free rows."""

import json
import re

import pytest
from model_fixtures import assert_no_leak, make_tiny_model, make_tokenizer

from tandem import LLM, SamplingParams, StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema")  # a dev dependency; GPU hosts may lack it

pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "city", "n"],
    "additionalProperties": False,
}
PROMPTS = ["The capital of France is", "Hello, my name is"]


@pytest.fixture(scope="module")
def llm():
    tok = make_tokenizer()
    return LLM(make_tiny_model("llama", eos_token_id=tok.eos_token_id), tokenizer=tok, block_size=4)


def sample(llm, so, n=6, seeds=(0, 1), **kw):
    outs = []
    for seed in seeds:
        params = SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=48,
                                structured_outputs=so, **kw)
        outs += [c for o in llm.generate(PROMPTS, params, use_tqdm=False) for c in o.outputs]
    return outs


def test_json_schema_every_sample_validates(llm):
    outs = sample(llm, StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    assert len(outs) == 24
    for c in outs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len({c.text for c in outs}) > 1  # sampled, not one forced string
    assert_no_leak(llm)


def test_regex_and_choice(llm):
    pattern = r"[0-9]{3}-[a-z]{2}"
    for c in sample(llm, StructuredOutputsParams(regex=pattern)):
        assert re.fullmatch(pattern, c.text), c.text
    choices = ["yes", "no", "maybe so"]
    texts = {c.text for c in sample(llm, StructuredOutputsParams(choice=choices))}
    assert texts <= set(choices) and len(texts) > 1


def test_constrained_rows_beside_free_ones(llm):
    """One batch: a constrained request, a free one and a greedy constrained one; the free
    request's tokens are those it gets alone."""
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate(PROMPTS[:1], free, use_tqdm=False)[0].outputs[0].token_ids
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    params = [SamplingParams(temperature=1.0, seed=3, max_tokens=48, structured_outputs=so), free,
              SamplingParams(temperature=0, max_tokens=48, structured_outputs=so)]
    outs = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[1]], params, use_tqdm=False)
    jsonschema.validate(json.loads(outs[0].outputs[0].text), SCHEMA)
    jsonschema.validate(json.loads(outs[2].outputs[0].text), SCHEMA)
    assert outs[1].outputs[0].token_ids == alone


def test_async_scheduling_gives_the_same_outputs(llm):
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=48, structured_outputs=so)
    sync = [c.text for o in llm.generate(PROMPTS, params, use_tqdm=False) for c in o.outputs]
    tok = llm.get_tokenizer()
    other = LLM(make_tiny_model("llama", eos_token_id=tok.eos_token_id), tokenizer=tok, block_size=4,
                async_scheduling=True)
    filler = other.llm_engine.worker.model_runner.fill_bitmask
    fills = []
    fill_async = filler.fill_async
    filler.fill_async = lambda matchers: fills.append(len(matchers)) or fill_async(matchers)
    got = [c.text for o in other.generate(PROMPTS, params, use_tqdm=False) for c in o.outputs]
    assert got == sync
    # the masks were filled on the worker thread while the engine read the previous step back
    assert fills and max(fills) == 2 * len(PROMPTS)
    assert_no_leak(other)


def test_bad_constraints_are_refused(llm):
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match="invalid grammar"):
        llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9")),
                     use_tqdm=False)
    assert_no_leak(llm)
