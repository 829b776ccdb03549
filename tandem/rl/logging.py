"""Per-step training metrics to the console, a JSONL file and TensorBoard (when installed)."""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any, Self, TextIO

from tandem.rl import progress

METRICS_FILE = "metrics.jsonl"
COMPLETIONS_FILE = "completions.jsonl"
TENSORBOARD_DIR = "tensorboard"

def _to_float(value: Any) -> float | None:
    if isinstance(value, (list, tuple)):
        values = [v for v in (_to_float(x) for x in value) if v is not None]
        return sum(values) / len(values) if values else None
    if hasattr(value, "item"):
        value = value.detach().float().mean().item() if hasattr(value, "detach") else value.item()
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class MetricsLogger:
    """Writes one record per logged step. Values may be numbers, 0-d tensors, or lists (averaged).

    resume_step: drop records after this step from an existing metrics.jsonl (they belong to a run
    that crashed after its last checkpoint), and tell TensorBoard to do the same.
    total_steps: show a progress bar over the steps (on a terminal); the console gets a compact
    line of a fixed set of figures (progress.CONSOLE_KEYS) per logged step.
    """

    def __init__(
        self,
        output_dir: str,
        report_to: Sequence[str] = ("jsonl", "tensorboard"),
        console: TextIO | None = sys.stdout,
        resume_step: int | None = None,
        total_steps: int | None = None,
    ) -> None:
        self.output_dir = output_dir
        self.console = console
        self._bar = None
        if console is not None and total_steps:
            self._bar = progress.TrainProgress(total_steps, initial=resume_step or 0)
        self._jsonl: TextIO | None = None
        self._completions: TextIO | None = None
        self._tb = None
        os.makedirs(output_dir, exist_ok=True)
        if "jsonl" in report_to:
            path = os.path.join(output_dir, METRICS_FILE)
            if resume_step is not None:
                _truncate_after(path, resume_step)
            self._jsonl = open(path, "a", encoding="utf-8")  # noqa: SIM115 - held until close()
        if "tensorboard" in report_to:
            self._tb = _tensorboard_writer(
                os.path.join(output_dir, TENSORBOARD_DIR),
                None if resume_step is None else resume_step + 1,
            )

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, float | None]:
        """Record `metrics` for `step`; returns them as plain floats."""
        values = {k: _to_float(v) for k, v in metrics.items()}
        record = {"step": step, "time": round(time.time(), 3)}
        record.update(
            {k: (v if v is None or math.isfinite(v) else None) for k, v in values.items()}
        )
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for k, v in values.items():
                if v is not None and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._bar is not None:
            self._bar.update(step, values)
        if self.console is not None:
            progress.write(progress.console_line(step, values), self.console)
        return values

    def log_completions(
        self,
        step: int,
        prompts: Sequence[str],
        completions: Sequence[str],
        rewards: Sequence[float],
        advantages: Sequence[float] | None = None,
        num_to_print: int | None = 4,
        extra: dict[str, Sequence[Any]] | None = None,
    ) -> None:
        """Append every (prompt, completion, reward) to completions.jsonl, with any `extra`
        columns (a reward function's log_extra); print a few."""
        if self._completions is None:
            path = os.path.join(self.output_dir, COMPLETIONS_FILE)
            self._completions = open(path, "a", encoding="utf-8")  # noqa: SIM115
        advantages = advantages if advantages is not None else [None] * len(prompts)
        for i, (p, c, r, a) in enumerate(zip(prompts, completions, rewards, advantages)):
            row = {
                "step": step,
                "prompt": p,
                "completion": c,
                "reward": _to_float(r),
                "advantage": _to_float(a),
            }
            row.update({k: v[i] for k, v in (extra or {}).items() if i < len(v)})
            self._completions.write(json.dumps(row) + "\n")
        self._completions.flush()
        if self.console is not None and num_to_print:
            n = min(num_to_print, len(prompts))
            table = progress.completions_table(
                step, prompts[:n], completions[:n], [_to_float(r) for r in rewards[:n]],
                [_to_float(a) for a in advantages[:n]], len(prompts))
            progress.write(table, self.console)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        for f in (self._jsonl, self._completions):
            if f is not None:
                f.close()
        self._jsonl = self._completions = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tensorboard_writer(log_dir: str, purge_step: int | None):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        warnings.warn(
            "tensorboard is not installed; skipping TensorBoard logging (pip install tensorboard)",
            stacklevel=3,
        )
        return None
    return SummaryWriter(log_dir=log_dir, purge_step=purge_step)


def _truncate_after(path: str, step: int) -> None:
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(tmp, path)
