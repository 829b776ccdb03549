"""Prompt datasets, chat rendering and the resumable RepeatSampler."""

from __future__ import annotations

import json
import re

import pytest

from tandem.rl.data import (
    RepeatSampler,
    arithmetic_dataset,
    build_prompt_batch,
    load_prompt_dataset,
    render_prompt,
    tokenize_prompts,
)

# ---- the arithmetic task ----------------------------------------------------------------------


def _solve(question: str) -> int:
    a, op, b = re.match(r"What is (\d+) ([-+*]) (\d+)\?", question).groups()
    return {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]


def test_arithmetic_answers_are_right_and_deterministic():
    ds = arithmetic_dataset(50, seed=3)
    assert ds.column_names == ["prompt", "answer"] and len(ds) == 50
    for row in ds:
        assert row["prompt"][0]["role"] == "user"
        assert str(_solve(row["prompt"][0]["content"])) == row["answer"]
    assert arithmetic_dataset(50, seed=3)["answer"] == ds["answer"]
    assert arithmetic_dataset(50, seed=4)["answer"] != ds["answer"]


def test_arithmetic_splits_are_disjoint():
    train = arithmetic_dataset(2000, seed=0, conversational=False)
    test = arithmetic_dataset(200, seed=1, split="test", conversational=False)
    assert isinstance(train[0]["prompt"], str)
    assert not set(train["prompt"]) & set(test["prompt"])


def test_arithmetic_errors():
    with pytest.raises(ValueError, match="only .* distinct problems"):
        arithmetic_dataset(100, split="test", max_operand=5)
    with pytest.raises(ValueError, match="ops"):
        arithmetic_dataset(5, ops=("/",))


# ---- loading ----------------------------------------------------------------------------------


def test_load_from_files_and_objects(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(4)]
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows))
    ds = load_prompt_dataset(str(jsonl))
    assert ds["prompt"] == ["q0", "q1", "q2", "q3"] and ds["answer"][2] == "2"
    parquet = tmp_path / "data.parquet"
    ds.to_parquet(str(parquet))
    assert load_prompt_dataset(parquet)["prompt"] == ds["prompt"]
    assert load_prompt_dataset(ds) is ds
    assert len(load_prompt_dataset("arithmetic", split="test")) == 200


def test_load_errors_name_the_problem(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"question": "hi", "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match=r"no 'prompt' column \(it has \['question', 'answer'\]\)"):
        load_prompt_dataset(str(path))
    assert load_prompt_dataset(str(path), prompt_column="question")["prompt"] == ["hi"]
    with pytest.raises(FileNotFoundError, match="built-in datasets: arithmetic"):
        load_prompt_dataset(str(tmp_path / "missing.jsonl"))
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ValueError, match="unsupported file type"):
        load_prompt_dataset(str(tmp_path / "x.txt"))


# ---- rendering --------------------------------------------------------------------------------


def test_render_prompt(tiny_tokenizer):
    assert render_prompt("plain text", tiny_tokenizer) == "plain text"
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    assert render_prompt(chat, tiny_tokenizer) == "<|system|>S<|end|><|user|>Q<|end|><|assistant|>"
    with pytest.raises(ValueError, match="lacks 'role' or 'content'"):
        render_prompt([{"content": "Q"}], tiny_tokenizer)
    with pytest.raises(TypeError, match="a prompt must be"):
        render_prompt(42, tiny_tokenizer)
    with pytest.raises(ValueError, match="chat template"):
        render_prompt(chat, None)


def test_tokenize_prompts_truncates_from_the_left(tiny_tokenizer):
    full = tokenize_prompts(["abcdef"], tiny_tokenizer, None)[0]
    assert tokenize_prompts(["abcdef"], tiny_tokenizer, 3)[0] == full[-3:]


def test_build_prompt_batch(tiny_tokenizer):
    ds = arithmetic_dataset(6, seed=0)
    batch = build_prompt_batch(ds, [4, 1], tiny_tokenizer, max_prompt_length=64)
    assert batch.indices == [4, 1]
    assert batch.texts[0].startswith("<|user|>What is") and batch.texts[0].endswith("<|assistant|>")
    assert all(len(ids) <= 64 for ids in batch.prompt_ids)
    assert batch.reward_columns(3)["answer"] == [ds[4]["answer"]] * 3 + [ds[1]["answer"]] * 3
    assert batch.repeated_prompts(2)[1] == ds[4]["prompt"]


# ---- sampling ---------------------------------------------------------------------------------


def test_repeat_sampler_layout_matches_trl():
    s = RepeatSampler(7, mini_repeat_count=2, batch_size=3, repeat_count=2, shuffle=False)
    assert list(s) == [0, 0, 1, 1, 2, 2] * 2 + [3, 3, 4, 4, 5, 5] * 2  # index 6 dropped
    assert len(s) == 24
    assert list(s)[:2] == [0, 0]  # next epoch starts


def test_repeat_sampler_epochs_are_seeded_permutations():
    s = RepeatSampler(10, batch_size=5, seed=1)
    e0 = s.next_batch() + s.next_batch()
    e1 = s.next_batch() + s.next_batch()
    assert sorted(e0) == sorted(e1) == list(range(10)) and e0 != e1
    s2 = RepeatSampler(10, batch_size=5, seed=1)
    assert s2.next_batch() + s2.next_batch() == e0


def test_repeat_sampler_resumes_exactly():
    a = RepeatSampler(9, mini_repeat_count=4, batch_size=2, seed=7)
    for _ in range(5):  # into the second epoch (4 batches each)
        a.next_batch()
    state = a.state_dict()
    expected = [a.next_batch() for _ in range(6)]
    b = RepeatSampler(9, mini_repeat_count=4, batch_size=2, seed=7)
    b.load_state_dict(json.loads(json.dumps(state)))
    assert [b.next_batch() for _ in range(6)] == expected
    with pytest.raises(ValueError, match="batch_size=2 but this one has 3"):
        RepeatSampler(9, batch_size=3, seed=7).load_state_dict(state)


def test_repeat_sampler_needs_enough_prompts():
    with pytest.raises(ValueError, match="needs 8 distinct prompts but the dataset has 5"):
        RepeatSampler(5, batch_size=8)
