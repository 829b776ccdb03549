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

METRICS_FILE = "metrics.jsonl"
COMPLETIONS_FILE = "completions.jsonl"
TENSORBOARD_DIR = "tensorboard"

# Shown first on the console line, in this order, when present.
_CONSOLE_KEYS = (
    "loss",
    "reward",
    "reward_std",
    "kl",
    "clip_ratio/region_mean",
    "learning_rate",
    "grad_norm",
    "completions/mean_length",
    "step_time",
)


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
    """

    def __init__(
        self,
        output_dir: str,
        report_to: Sequence[str] = ("jsonl", "tensorboard"),
        console: TextIO | None = sys.stdout,
        resume_step: int | None = None,
    ) -> None:
        self.output_dir = output_dir
        self.console = console
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
        if self.console is not None:
            print(_console_line(step, values), file=self.console, flush=True)
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
            for p, c, r in list(zip(prompts, completions, rewards))[:num_to_print]:
                print(f"  [{_fmt(_to_float(r))}] {_clip(p)!r} -> {_clip(c)!r}", file=self.console)

    def close(self) -> None:
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


def _fmt(v: float | None) -> str:
    if v is None:
        return "nan"
    return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.3e}"


def _clip(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _console_line(step: int, values: dict[str, float | None]) -> str:
    keys = [k for k in _CONSOLE_KEYS if k in values]
    keys += sorted(k for k in values if k not in _CONSOLE_KEYS and not k.startswith("rewards/"))
    keys += sorted(k for k in values if k.startswith("rewards/") and k.endswith("/mean"))
    return f"step {step:>5} | " + " | ".join(f"{k} {_fmt(values[k])}" for k in keys)
