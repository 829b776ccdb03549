"""Reward functions as TRL takes them: a sequence-classification reward model (or its directory),
async functions run concurrently, None for samples a function does not score, and
completion_ids / trainer_state / dataset columns handed to every function."""

import asyncio

import pytest
import torch
from datasets import Dataset
from model_fixtures import make_tiny_model, make_tokenizer

from tandem.rl import GRPOConfig, GRPOTrainer
from tandem.rl.reward_models import RewardModel, prepare_reward_funcs
from tandem.rl.rewards import RewardComputer

PROMPTS = ["Hello, my name is", "The capital of France is", "Once upon a time", "one two three"]


def tiny_reward_model():
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    return LlamaForSequenceClassification(cfg).eval()


def make(tmp_path, reward_funcs, **kw):
    args = GRPOConfig(output_dir=str(tmp_path), num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=4, max_prompt_length=16, max_steps=2, report_to="none",
                      save_strategy="no", seed=0)
    return GRPOTrainer(make_tiny_model("llama", seed=3), reward_funcs, args,
                       train_dataset=Dataset.from_dict({"prompt": PROMPTS, "tag": list("abcd")}),
                       processing_class=make_tokenizer(), engine_kwargs={"device": "cpu"}, **kw)


def test_a_reward_model_scores_and_matches_its_own_forward(tmp_path):
    rm, tok = tiny_reward_model(), make_tokenizer()
    rm_dir = tmp_path / "rm"
    rm.save_pretrained(rm_dir)
    tok.save_pretrained(rm_dir)
    trainer = make(tmp_path / "run", [rm, str(rm_dir)], reward_processing_classes=[tok, None])
    m = trainer.step()
    a, b = (m[f"rewards/{n}/mean"] for n in trainer.rewards.names)
    assert a == pytest.approx(b, abs=1e-5) and a != 0.0  # the model and its saved directory agree
    # the score is the model's first logit on prompt + completion, padded on the right
    f = trainer.rewards.funcs[0]
    assert isinstance(f, RewardModel)
    enc = tok(["Hi there"], return_tensors="pt", add_special_tokens=False)
    assert f(["Hi"], [" there"])[0] == pytest.approx(rm(**enc).logits[0, 0].item(), abs=1e-5)


def test_reward_processing_classes_must_match_the_functions():
    with pytest.raises(ValueError, match="one per function"):
        prepare_reward_funcs([len, len], [None], torch.device("cpu"))


def test_async_reward_functions_run_concurrently():
    started = {}

    async def first(completions, **kw):
        started["first"] = asyncio.Event()
        await asyncio.wait_for(started.setdefault("second", asyncio.Event()).wait(), 5)
        return [1.0] * len(completions)

    async def second(completions, **kw):
        started.setdefault("second", asyncio.Event()).set()  # run one after the other: first times out
        return [2.0] * len(completions)

    r = RewardComputer([first, second])(["p", "q"], ["a", "b"])
    assert r.rewards.tolist() == [3.0, 3.0] and r.names == ["first", "second"]


def test_async_reward_that_raises_is_located():
    async def bad(completions, **kw):
        if any(c == "b" for c in completions):
            raise ValueError("no b")
        return [1.0] * len(completions)

    with pytest.raises(Exception, match=r"'bad' raised ValueError: no b \(at sample 1\)"):
        RewardComputer([bad])(["p", "q"], ["a", "b"])


def test_none_rewards_async_rewards_and_what_rewards_receive(tmp_path):
    seen = {}

    def half(completions, completion_ids, trainer_state, tag, **kw):
        seen.update(step=trainer_state.global_step, tag=tag, ids=completion_ids)
        return [None if i % 2 else 1.0 for i in range(len(completions))]

    async def judge(prompts, completions, **kw):
        await asyncio.sleep(0)
        return [float(len(c) % 3) for c in completions]

    trainer = make(tmp_path, [half, judge])
    m = trainer.step()
    assert seen["step"] == 0 and seen["tag"] == list("aaaabbbb")
    assert all(isinstance(ids, list) and ids for ids in seen["ids"])
    assert m["rewards/half/mean"] == 1.0  # None is left out, not counted as 0
    assert torch.isfinite(torch.tensor(m["loss"]))
    trainer.step()
    assert seen["step"] == 1  # the TrainerState moves with the optimizer steps


def test_log_metric_and_log_extra_as_trl_passes_them(tmp_path):
    def scored(completions, log_metric, log_extra, **kw):
        log_metric("judge/latency", 2.0)
        log_extra("judge_note", [f"n{i}" for i in range(len(completions))])
        return [1.0] * len(completions)

    trainer = make(tmp_path, scored)
    trainer.args.log_completions = True
    trainer.train()
    assert trainer.state.log_history[0]["judge/latency"] == 2.0
    import json

    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert rows[0]["judge_note"] == "n0"
