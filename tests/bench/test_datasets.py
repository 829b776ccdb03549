"""Prompt sources: random words, random tokens through a tokenizer, ShareGPT JSON, JSONL."""

import json

import pytest

from tandem.bench.datasets import DatasetConfig, load_requests, random_requests


def test_random_words_have_the_asked_lengths_marked_approximate():
    specs = load_requests(
        DatasetConfig(num_prompts=50, input_len=100, output_len=20, range_ratio=0.5, seed=1)
    )
    assert len(specs) == 50
    assert all(50 <= s.prompt_len <= 150 and 10 <= s.output_len <= 30 for s in specs)
    assert all(len(s.prompt.split()) == s.prompt_len and s.approx_len for s in specs)
    assert len({s.prompt for s in specs}) == 50  # no shared prompts (no prefix-cache hits)
    again = load_requests(
        DatasetConfig(num_prompts=50, input_len=100, output_len=20, range_ratio=0.5, seed=1)
    )
    assert [s.prompt for s in specs] == [s.prompt for s in again]


def test_random_tokens_with_a_tokenizer_are_exact(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {f"w{i}": i for i in range(200)} | {"[UNK]": 200}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.save_pretrained(tmp_path)
    specs = load_requests(
        DatasetConfig(num_prompts=5, input_len=40, output_len=8, tokenizer=str(tmp_path))
    )
    assert [s.prompt_len for s in specs] == [40] * 5
    assert not any(s.approx_len for s in specs)
    assert "[UNK]" not in specs[0].prompt


class _Lossy:
    """A tokenizer whose decoded text encodes to nothing (as a vocabulary of made-up pieces)."""

    all_special_ids: list[int] = []
    vocab_size = 100
    name_or_path = "lossy"

    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)

    def encode(self, text, add_special_tokens=False):
        return []


def test_a_tokenizer_whose_decoded_ids_do_not_encode_again_is_refused():
    config = DatasetConfig(num_prompts=2, input_len=10, output_len=4)
    with pytest.raises(ValueError, match="--tokenizer: random token ids do not decode"):
        random_requests(config, _Lossy())  # rather than empty prompts sent as 10-token ones


def test_sharegpt_first_turns_and_vllm_filter(tmp_path):
    words = " ".join(["word"] * 40)
    data = [
        {"conversations": [{"from": "human", "value": words}, {"from": "gpt", "value": words}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": words}]},
        {"conversations": [{"from": "human", "value": words}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    specs = load_requests(
        DatasetConfig(dataset_name="sharegpt", dataset_path=str(path), num_prompts=3)
    )
    # only the first conversation passes (the second's prompt is < 4 tokens); it is cycled
    assert [s.prompt for s in specs] == [words] * 3
    assert specs[0].output_len == round(len(words) / 4) and specs[0].approx_len
    fixed = load_requests(
        DatasetConfig(
            dataset_name="sharegpt", dataset_path=str(path), num_prompts=2, sharegpt_output_len=7
        )
    )
    assert [s.output_len for s in fixed] == [7, 7]


def test_jsonl_prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('"just a string"\n{"prompt": "p2", "output_len": 5}\n\n{"text": "p3"}\n')
    specs = load_requests(
        DatasetConfig(dataset_name="jsonl", dataset_path=str(path), num_prompts=3, output_len=9)
    )
    assert [(s.prompt, s.output_len) for s in specs] == [("just a string", 9), ("p2", 5), ("p3", 9)]


def test_dataset_validation():
    with pytest.raises(ValueError, match="--dataset-path"):
        DatasetConfig(dataset_name="sharegpt")
    with pytest.raises(ValueError, match="range_ratio"):
        DatasetConfig(range_ratio=1.0)
