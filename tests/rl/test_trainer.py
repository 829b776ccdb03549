"""GRPOTrainer end to end on a CPU: a tiny model learns from the engine's rollouts; resume is exact."""

import json

import pytest
from datasets import Dataset
from model_fixtures import make_tiny_model, make_tokenizer, record_schedules

from tandem.rl import GRPOConfig, GRPOTrainer

TARGET = 42  # reward: share of completion tokens equal to this id


def target_share(prompts, completions, completion_ids, **kwargs):
    return [sum(t == TARGET for t in ids) / max(1, len(ids)) for ids in completion_ids]


def make_trainer(tmp_path, **overrides):
    tok = make_tokenizer()
    model = make_tiny_model("llama", seed=3)
    prompts = ["Hello, my name is", "The capital of France is", "What is 2 + 3?", "Once upon a time",
               "one two three", "The answer is", "I generate text", "small model"]
    cfg = {
        "output_dir": str(tmp_path), "num_generations": 8, "per_device_train_batch_size": 16,
        "gradient_accumulation_steps": 2, "max_completion_length": 8, "max_prompt_length": 32, "learning_rate": 1e-2,
        "max_steps": 12, "temperature": 1.0, "report_to": "none", "gradient_checkpointing": False,
        "lr_scheduler_type": "constant", "seed": 0, "vllm_gpu_memory_utilization": 0.1, "save_steps": 10**6,
        "use_cpu": True,  # the engine is on the CPU (engine_kwargs), on a GPU host too
    }
    cfg.update(overrides)
    return GRPOTrainer(model, target_share, GRPOConfig(**cfg), train_dataset=Dataset.from_dict({"prompt": prompts}),
                       processing_class=tok, engine_kwargs={"device": "cpu"})


@pytest.mark.parametrize("sleep_mode", [None, True])  # the plan's choice (awake here), forced sleep
def test_tiny_model_learns_from_engine_rollouts(tmp_path, sleep_mode):
    trainer = make_trainer(tmp_path, vllm_enable_sleep_mode=sleep_mode)
    rewards = []
    for _ in range(12):
        rewards.append(trainer.step()["reward"])
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.25 and last > 0.4, rewards
    # one weight sync per optimizer-step round, each visible as a new engine weights version
    assert trainer.llm.llm_engine.weights_version == trainer.generator.weight_sync.num_syncs
    # slept between rollouts, or (the plan's choice: everything fits) stayed awake throughout
    assert trainer.llm.llm_engine.is_sleeping == bool(sleep_mode)
    assert trainer.generator.sleep_level == (2 if sleep_mode else None)
    bm = trainer.llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_a_bare_step_keeps_full_gc_passes_off_the_heap_it_started_with(tmp_path, monkeypatch):
    """A loop of step() calls (bench rl's, a user's own) gets train()'s frozen heap a step at a time."""
    import gc

    trainer = make_trainer(tmp_path, max_steps=1)
    frozen = []
    inner = trainer._step
    monkeypatch.setattr(trainer, "_step", lambda: frozen.append(gc.get_freeze_count()) or inner())
    before = gc.get_freeze_count()
    trainer.step()
    assert frozen[0] > before and gc.get_freeze_count() == before  # frozen inside, given back after


def test_a_skipped_weight_sync_is_caught(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, max_steps=2)
    m = trainer.step()
    # the phases' spans, for GPU monitors: in order, back to back, as long as the logged times
    spans = trainer.last_phase_spans
    assert list(spans) == ["weight_sync", "generate", "reward", "train"]
    ends = [b for _, b in spans.values()]
    assert all(a <= b for a, b in spans.values()) and ends == sorted(ends)
    assert spans["train"][1] - spans["train"][0] == pytest.approx(m["time/train"])
    monkeypatch.setattr(trainer.llm.llm_engine, "load_weights", lambda weights, specs=None: 0)
    with pytest.raises(RuntimeError, match="weight sync"):
        trainer.step()


def test_resume_gives_the_same_next_step(tmp_path):
    straight = make_trainer(tmp_path / "a", max_steps=6)
    for _ in range(2):
        straight.step()
    path = straight.save_checkpoint()
    expected = straight.step()
    resumed = make_trainer(tmp_path / "b", max_steps=6)
    resumed._resume(str(path))
    assert resumed.global_step == straight.global_step - 1
    got = resumed.step()
    assert got["reward"] == pytest.approx(expected["reward"], abs=1e-6)
    assert got["loss"] == pytest.approx(expected["loss"], abs=1e-5)


def test_a_checkpoint_resumes_only_with_the_fsdp_setting_it_was_written_with(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=2)
    path = trainer.save_checkpoint()
    state_file = path / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["config"]["fsdp"] = True  # as an FSDP run writes it: optimizer state keyed by name
    state_file.write_text(json.dumps(state))
    with pytest.raises(ValueError, match="fsdp=True"):
        make_trainer(tmp_path, max_steps=2)._resume(str(path))


def test_bad_configuration_is_refused_before_training(tmp_path):
    with pytest.raises(ValueError, match="num_generations"):
        GRPOConfig(num_generations=1)
    with pytest.raises(ValueError, match="divisible|multiple"):
        GRPOConfig(num_generations=3, per_device_train_batch_size=4)
    with pytest.raises(ValueError, match="prompt"):
        GRPOTrainer(make_tiny_model("llama"), target_share, GRPOConfig(output_dir=str(tmp_path)),
                    train_dataset=Dataset.from_dict({"question": ["hi"] * 8}), processing_class=make_tokenizer())
    with pytest.raises(ValueError, match="context"):
        make_trainer(tmp_path, max_completion_length=600)


def _fake_old_run(out):
    old = out / "checkpoint-3"
    old.mkdir(parents=True)
    (old / "checkpoint_complete.json").write_text("{}")
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')


def test_a_fresh_run_refuses_an_output_dir_holding_another_runs_checkpoints(tmp_path):
    _fake_old_run(tmp_path)
    trainer = make_trainer(tmp_path, max_steps=1, save_steps=1, report_to="jsonl")
    with pytest.raises(ValueError, match="checkpoint-3.*--overwrite-output-dir"):
        trainer.train()
    assert trainer.global_step == 0  # refused before any step
    trainer.args.overwrite_output_dir = True
    trainer.train()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1"]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1]


def test_resume_falls_back_past_a_corrupt_checkpoint(tmp_path, capsys):
    trainer = make_trainer(tmp_path, max_steps=6)
    trainer.step()
    trainer.save_checkpoint()
    trainer.step()
    newest = trainer.save_checkpoint()
    (newest / "model.safetensors").write_bytes(b"\x00garbage, but marked complete")
    resumed = make_trainer(tmp_path, max_steps=6)
    assert resumed._resume(True) == 1
    err = capsys.readouterr().err
    assert "checkpoint-2" in err and "resumed from checkpoint-1" in err
    (tmp_path / "checkpoint-1" / "trainer_state.json").write_text("{")
    with pytest.raises(ValueError, match="no checkpoint .* could be loaded"):
        make_trainer(tmp_path, max_steps=6)._resume(True)


def test_trl_structured_outputs_regex_constrains_rollouts_and_evaluation(tmp_path):
    """vllm_structured_outputs_regex (TRL's): every rollout and greedy evaluation completion matches
    it. The engine reports the grammar-masked distribution's logprobs (vLLM's), so they are never
    below the trainer's unmasked ones, and above them where the mask removed mass."""
    import re

    pytest.importorskip("llguidance")
    regex = "(yes|no|maybe)"
    trainer = make_trainer(tmp_path, max_steps=1, vllm_structured_outputs_regex=regex,
                           eval_strategy="no")
    seen = {}
    rollout, run = trainer.generator.rollout, trainer.update.run

    def capture_rollout(*a, **k):
        seen["rollout"] = rollout(*a, **k)
        return seen["rollout"]

    def capture_run(data, *a, **k):
        seen["data"], seen["logp"] = data, trainer.update.logps(trainer.model, data, no_grad=True)
        return run(data, *a, **k)

    trainer.generator.rollout, trainer.update.run = capture_rollout, capture_run
    trainer.step()
    texts = seen["rollout"].texts
    assert texts and all(re.fullmatch(regex, t) for t in texts), texts
    mask = seen["data"]["completion_mask"].bool() & (seen["data"]["engine_logp"] != 0)
    engine, ours = seen["data"]["engine_logp"][mask], seen["logp"][mask]
    assert (engine >= ours - 1e-4).all() and (engine > ours + 1e-3).any()
    metrics = trainer.evaluate(trainer.train_dataset, num_samples=4)
    assert "eval/reward" in metrics
    greedy, _ = trainer.generator.greedy([[5, 6, 7]], 8, trainer.structured_outputs)
    assert re.fullmatch(regex, greedy[0])


def test_structured_outputs_regex_is_checked_before_anything_loads():
    pytest.importorskip("llguidance")
    with pytest.raises(ValueError, match="vllm_structured_outputs_regex='\\(yes'"):
        GRPOConfig(output_dir="/tmp/x", vllm_structured_outputs_regex="(yes")
    with pytest.raises(ValueError, match="batch_invariant"):
        GRPOConfig(output_dir="/tmp/x", vllm_structured_outputs_regex="yes", batch_invariant=True)
    with pytest.raises(ValueError, match="vllm_guided_decoding_regex.*vllm_structured_outputs_regex"):
        GRPOConfig(output_dir="/tmp/x", vllm_guided_decoding_regex="yes")


def test_rewards_are_scored_while_the_first_forward_pass_runs(tmp_path, monkeypatch):
    """Plain reward functions run once the train phase's first forward pass is launched (the
    device computes it meanwhile); a reward model scores before the train phase, on its own. Both
    orders train to the same weights and metrics."""
    import torch

    from tandem.rl.rewards import RewardComputer

    runs = {}
    for overlap in (True, False):
        if not overlap:
            monkeypatch.setattr(RewardComputer, "runs_models", property(lambda self: True))
        trainer = make_trainer(tmp_path / str(overlap), max_steps=2)
        events = []
        logps = trainer.update.logps
        monkeypatch.setattr(trainer.update, "logps", lambda *a, **k: events.append("forward") or logps(*a, **k))
        funcs = trainer.rewards.funcs
        monkeypatch.setattr(trainer.rewards, "funcs", [lambda **kw: events.append("reward") or funcs[0](**kw)])
        metrics = [trainer.step() for _ in range(2)]
        spans = trainer.last_phase_spans
        runs[overlap] = metrics, [p.detach().clone() for p in trainer.model.parameters()], events, spans
    (m_on, w_on, ev_on, sp_on), (m_off, w_off, ev_off, sp_off) = runs[True], runs[False]
    assert ev_on[:2] == ["forward", "reward"] and ev_on.count("reward") == 2
    assert ev_off[0] == "reward"
    for a, b in zip(w_on, w_off):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for key in ("reward", "loss", "grad_norm", "completions/mean_length"):
        assert [m[key] for m in m_on] == [m[key] for m in m_off]
    # overlapped, the reward span sits inside the train span; else just before it
    assert sp_on["train"][0] <= sp_on["reward"][0] <= sp_on["reward"][1] <= sp_on["train"][1]
    assert sp_off["reward"][1] <= sp_off["train"][0]
    for m in m_on:
        assert m["time/step"] == pytest.approx(m["time/weight_sync"] + m["time/generate"] + m["time/train"], abs=1e-3)


def test_rollouts_in_decode_windows_sample_what_single_steps_do(tmp_path):
    """The colocated engine may run its decode steps in windows (num_scheduler_steps): the seeded
    rollouts are the same tokens, and the step trains to the same loss (the engine logprobs of a
    sample that stopped inside a window may differ in the last bits: the CPU's GEMMs depend on
    the batch size)."""
    import torch

    runs = []
    for steps in (1, 4):
        trainer = make_trainer(tmp_path / str(steps), max_steps=1)
        trainer.llm.llm_engine.scheduler.num_scheduler_steps = steps
        windows = record_schedules(trainer.llm)
        texts = []
        rollout = trainer.generator.rollout
        trainer.generator.rollout = lambda *a, **k: texts.append(r := rollout(*a, **k)) or r
        m = trainer.step()
        assert max(w.num_steps for w in windows) == steps
        runs.append((texts[0].completion_ids, m, [p.detach().clone() for p in trainer.model.parameters()]))
    (ids_1, m_1, w_1), (ids_4, m_4, w_4) = runs
    assert ids_4 == ids_1 and any(len(c) < 8 for c in ids_1)  # some stopped early (EOS)
    assert m_4["loss"] == pytest.approx(m_1["loss"], abs=1e-5)
    for a, b in zip(w_4, w_1):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
