"""MetricsLogger: console line, JSONL records, TensorBoard events, resume truncation."""

from __future__ import annotations

import io
import json

import pytest
import torch

from tandem.rl.logging import METRICS_FILE, MetricsLogger


def _records(path):
    return [json.loads(line) for line in (path / METRICS_FILE).read_text().splitlines()]


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
    assert text.startswith("step     1 | loss 0.5 | reward 0.5 | kl nan")
    assert "'p1' -> 'c1'" in text and "'p2'" not in text
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
