"""Invariant 4: bad input is a ValueError naming the field, raised before any work starts."""

import pytest
from model_fixtures import assert_no_leak, make_tiny_model

from tandem import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(make_tiny_model("llama"), block_size=4, max_model_len=64)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_leave_engine_usable(llm):
    good = [1, 2, 3]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = llm.generate([good], params, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([good, list(range(64))], params, use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([good, [1, 99999]], params, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], params, use_tqdm=False)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["text needs a tokenizer"], params, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([good, good], [params], use_tqdm=False)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}])
    assert_no_leak(llm)
    assert llm.generate([good], params, use_tqdm=False)[0].outputs[0].token_ids == expected


def test_bad_engine_config():
    model = make_tiny_model("llama")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(model, gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="block_size"):
        LLM(model, block_size=3)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model, max_model_len=100000)
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        LLM(model, block_size=4, num_gpu_blocks_override=2, max_model_len=64)
    with pytest.raises(TypeError, match="unknown engine argument"):
        LLM(model, max_num_seq=3)
    with pytest.raises(ValueError, match="max_admission_delay_steps"):
        LLM(model, max_admission_delay_steps=-1)


def test_unknown_model_path_and_architecture(tmp_path):
    with pytest.raises(ValueError, match="not a local directory"):
        LLM("/no/such/model")
    with pytest.raises(ValueError, match="load_format='dummy'"):
        LLM("qwen2.5-0.5b")
    import json

    make_tiny_model("llama").save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not supported"):
        LLM(str(tmp_path))


def test_chat_without_template(tmp_path):
    from model_fixtures import make_tokenizer

    tok = make_tokenizer()
    tok.chat_template = None
    llm = LLM(make_tiny_model("llama"), tokenizer=tok)
    with pytest.raises(ValueError, match="chat template"):
        llm.chat([{"role": "user", "content": "hi"}])


def test_out_of_vocabulary_stop_token_is_refused(llm):
    params = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[10**6])
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([[1, 2, 3]], params, use_tqdm=False)
    assert_no_leak(llm)
