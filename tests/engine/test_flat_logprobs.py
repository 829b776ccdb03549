"""Sample logprobs come as FlatLogprobs (vLLM's layout): six flat lists instead of a dict and a
Logprob per position, read as the list of {token id: Logprob} dicts they stand for."""

import pytest
from model_fixtures import make_tiny_model

from tandem import LLM, SamplingParams
from tandem.outputs import CompletionOutput, FlatLogprobs, Logprob, RequestOutput

POSITIONS = [{5: Logprob(-0.5, 1, "a")}, {7: Logprob(-2.0, 3, "b"), 1: Logprob(-0.1, 1, "c")},
             {9: Logprob(-1.25, 2, None)}]


def flat(positions):
    out = FlatLogprobs()
    for p in positions:
        out.append(p)
    return out


def test_reads_as_the_list_of_dicts_it_holds():
    f = flat(POSITIONS)
    assert len(f) == 3 and f[1] == POSITIONS[1] and f[-1] == POSITIONS[-1]
    assert list(f) == POSITIONS and f == POSITIONS and f != POSITIONS[:2]
    assert f[1:] == POSITIONS[1:] and isinstance(f[1:], FlatLogprobs)
    assert f.token_ids == [5, 7, 1, 9] and f.start_indices == [0, 1, 3] and f.end_indices == [1, 3, 4]
    with pytest.raises(IndexError):
        f[3]


def test_concatenation_keeps_every_position():
    a, b = flat(POSITIONS[:1]), flat(POSITIONS[1:])
    assert a + b == POSITIONS and isinstance(a + b, FlatLogprobs)
    assert a + POSITIONS[1:] == POSITIONS
    entries = [None]  # the server's echo: the prompt's positions (None first), then the sample's
    entries += b
    assert entries == [None, *POSITIONS[1:]] and type(entries) is list
    assert [None] + b == [None, *POSITIONS[1:]]


def test_delta_outputs_fold_into_the_whole():
    def out(positions, ids):
        return RequestOutput("r", None, [1], [CompletionOutput(0, "", ids, None, flat(positions))])

    whole = out(POSITIONS[:2], [5, 7])
    whole.add(out(POSITIONS[2:], [9]))
    assert whole.outputs[0].logprobs == POSITIONS and whole.outputs[0].token_ids == [5, 7, 9]


@pytest.mark.parametrize("k", [0, 2])
def test_engine_logprobs_are_flat_with_the_sampled_token_first(k, tiny_tokenizer_engine):
    llm = tiny_tokenizer_engine
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=6, ignore_eos=True, logprobs=k)
    c = llm.generate([[3, 4, 5]], params, use_tqdm=False)[0].outputs[0]
    assert isinstance(c.logprobs, FlatLogprobs) and len(c.logprobs) == len(c.token_ids) == 6
    for position, t in zip(c.logprobs, c.token_ids):
        assert next(iter(position)) == t  # the sampled token leads
        assert len(position) in (k, k + 1) if k else len(position) == 1
        assert position[t].decoded_token == llm.get_tokenizer().decode([t])
    if k == 0:
        assert c.logprobs.logprobs == [p[t].logprob for p, t in zip(c.logprobs, c.token_ids)]
    assert sum(c.logprobs.logprobs[c.logprobs.start_indices[i]] for i in range(6)) == pytest.approx(
        c.cumulative_logprob, abs=1e-4)


def test_without_detokenize_there_is_no_text(tiny_tokenizer_engine):
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=5, ignore_eos=True, logprobs=1, detokenize=False)
    c = tiny_tokenizer_engine.generate([[3, 4, 5]], params, use_tqdm=False)[0].outputs[0]
    assert c.text == "" and len(c.token_ids) == 5
    assert all(lp.decoded_token is None for position in c.logprobs for lp in position.values())


def test_stop_strings_need_detokenize():
    with pytest.raises(ValueError, match="detokenize=True"):
        SamplingParams(stop=["\n"], detokenize=False)
    SamplingParams(stop_token_ids=[2], detokenize=False)  # token ids need no text


@pytest.fixture(scope="module")
def tiny_tokenizer_engine():
    from tests.rl.conftest import make_tiny_tokenizer

    return LLM(make_tiny_model("llama", vocab_size=320), tokenizer=make_tiny_tokenizer(), block_size=4)
