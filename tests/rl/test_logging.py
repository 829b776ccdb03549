"""MetricsLogger: console line, JSONL records, TensorBoard events, resume truncation."""

from __future__ import annotations

import io
import json

import pytest
import torch

from tandem.rl import progress
from tandem.rl.logging import METRICS_FILE, MetricsLogger


def _records(path):
    return [json.loads(line) for line in (path / METRICS_FILE).read_text().splitlines()]


def test_console_line_is_a_fixed_set_in_a_fixed_order():
    values = {"time/step": 2.0, "rewards/accuracy_reward/mean": 0.3125, "zzz": 1.0, "reward": 1.2,
              "sampling/sampling_logp_difference/mean": 0.0123, "loss": 0.01}
    assert progress.console_line(3, values) == (
        "step     3 | loss 0.01 | reward 1.2 | accuracy 31.2% | |Δlogp| 0.0123 | s/step 2")
    assert progress.bar_postfix(values) == "reward 1.2, accuracy 31.2%, |Δlogp| 0.0123"


def test_progress_bar_shows_the_step_the_figures_and_an_eta():
    out = io.StringIO()
    bar = progress.TrainProgress(10, initial=2, file=out, enabled=True)
    bar.update(3, {"reward": 1.0})
    bar.update(5, {"reward": 1.5, "eval/accuracy_reward/mean": 0.25})
    bar.close()
    last = out.getvalue().split("\r")[-1]
    assert "5/10" in last and "reward 1.5, held-out 25.0%" in last and "<" in last  # elapsed<ETA
    bar = progress.TrainProgress(10, file=io.StringIO(), enabled=True)
    bar.update(1, {"reward": 1.0})
    bar.update(1, {"eval/accuracy_reward/mean": 0.5})  # an evaluation's record
    assert bar.bar.postfix == "reward 1, held-out 50.0%"


def test_the_logger_keeps_a_bar_only_for_a_console(tmp_path):
    with MetricsLogger(str(tmp_path), report_to=[], console=io.StringIO(), total_steps=10) as log:
        assert log._bar is not None  # silent here: the console is no terminal
        log.log(1, {"reward": 1.0})
    assert log._bar is None
    with MetricsLogger(str(tmp_path), report_to=[], console=None, total_steps=10) as log:
        assert log._bar is None


def test_completions_table_keeps_the_prompts_end_and_the_completions_start():
    table = progress.completions_table(4, ["x" * 200 + " What is 2+2?"], ["4" + " y" * 200],
                                       [1.0], [0.5], total=8, width=100)
    row = table.splitlines()[2]
    assert row.startswith("      1     +0.50  …") and "What is 2+2?  4 y" in row
    assert len(row) <= 100
    chat = "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
    row = progress.completions_table(1, [chat], ["7"], [1.0], [None], total=1).splitlines()[2]
    assert row.split() == ["1", "-", "user", "What", "is", "3", "+", "4?", "7"]


def test_jsonl_and_console(tmp_path):
    out = io.StringIO()
    with MetricsLogger(str(tmp_path), report_to=["jsonl"], console=out) as log:
        values = log.log(
            1,
            {
                "loss": torch.tensor(0.5),
                "reward": [1.0, 0.0],
                "kl": float("nan"),
                "rewards/acc/mean": 0.25,
            },
        )
        log.log_completions(1, ["p1", "p2"], ["c1", "c2"], [1.0, 0.0], num_to_print=1)
    assert values["loss"] == 0.5 and values["reward"] == 0.5
    rec = _records(tmp_path)[0]
    assert rec["step"] == 1 and rec["loss"] == 0.5 and rec["kl"] is None
    text = out.getvalue()
    assert text.startswith("step     1 | loss 0.5 | reward 0.5 | kl nan\n")  # fixed keys only
    table = text.splitlines()[1:]
    assert table[0] == "step 1: 1 of 2 completions"
    assert table[2].split() == ["1", "-", "p1", "c1"] and "p2" not in text
    rows = (tmp_path / "completions.jsonl").read_text().splitlines()
    assert json.loads(rows[1]) == {
        "step": 1,
        "prompt": "p2",
        "completion": "c2",
        "reward": 0.0,
        "advantage": None,
    }


def test_resume_drops_records_after_the_checkpoint(tmp_path):
    with MetricsLogger(str(tmp_path), report_to=["jsonl"], console=None) as log:
        for step in range(1, 6):
            log.log(step, {"loss": step})
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write('{"step": 6, "lo')  # cut short by a crash
    with MetricsLogger(str(tmp_path), report_to=["jsonl"], console=None, resume_step=3) as log:
        log.log(4, {"loss": 40})
    assert [(r["step"], r["loss"]) for r in _records(tmp_path)] == [(1, 1), (2, 2), (3, 3), (4, 40)]


def test_tensorboard_events(tmp_path):
    pytest.importorskip("tensorboard")
    with MetricsLogger(str(tmp_path), report_to=["tensorboard"], console=None) as log:
        log.log(1, {"loss": 1.0})
        log.log(2, {"loss": 0.25})
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert not (tmp_path / METRICS_FILE).exists()
    # the file holds the scalars, not just a header: read them back
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert "loss" in events.Tags()["scalars"]
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0), (2, 0.25)]


def test_the_demo_summary_states_accuracy_and_the_rewards_range_in_words():
    from tandem.rl.cli import summary_lines

    lines = summary_lines("accuracy,short", 32, [(0, 0.1875), (10, 0.3125)], {"eval/reward": 0.9},
                          {"eval/reward": 1.2}, "runs/x/reward_curve.png", "runs/x")
    assert lines == [
        "held-out accuracy (greedy, 32 problems): 18.8% before, 31.2% after 10 steps (+12.5 points)",
        "held-out reward 0.90 -> 1.20: the sum of accuracy + short (accuracy in [0, 1], short in "
        "[0, 1]), at most 2",
        "metrics: runs/x/metrics.jsonl; curves: runs/x/reward_curve.png",
    ]
