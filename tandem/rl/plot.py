"""The curves of a run, from its metrics.jsonl, as one PNG: rollout reward, held-out accuracy,
engine/trainer logprob agreement and step time over optimizer steps."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

LOGP_DIFF = "sampling/sampling_logp_difference/mean"


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_reward_curve(output_dir: str, path: str | None = None,
                      held_out: Sequence[tuple[int, float]] = (), accuracy_key: str | None = None) -> str | None:
    """Write `reward_curve.png` (or `path`); `held_out` holds (step, accuracy in [0, 1]) points
    measured outside the log (before and after training); `accuracy_key` names the per-rollout
    reward component that is the task's accuracy, drawn beside the total reward."""
    metrics = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.isfile(metrics):
        return None
    from tandem.bench.report import pyplot, save_figure

    with open(metrics) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), sharex=True)
    ax = axes[0][0]
    ax.plot(*_series(rows, "reward"), lw=1.2, label="total reward (sum of the reward functions)")
    if accuracy_key:
        ax.plot(*_series(rows, accuracy_key), lw=1.2, label="accuracy reward (0 or 1)")
    ax.set_ylabel("mean over the step's rollouts")
    ax.set_title("Rollout reward")
    ax.legend(fontsize=8)

    ax = axes[0][1]
    steps, acc = zip(*held_out) if held_out else ((), ())
    ax.plot(steps, [100 * a for a in acc], marker="o", lw=1.2, color="tab:green")
    for x, y in zip(steps, acc):
        ax.annotate(f"{100 * y:.1f}%", (x, 100 * y), textcoords="offset points", xytext=(0, 6),
                    ha="center", fontsize=8)
    ax.set_ylabel("% correct (greedy)")
    ax.set_ylim(0, 100)
    ax.set_title("Held-out accuracy")

    ax = axes[1][0]
    ax.plot(*_series(rows, LOGP_DIFF), lw=1.2, color="tab:red")
    ax.set_ylabel("mean |engine - trainer| (nats/token)")
    ax.set_ylim(bottom=0)
    ax.set_title("Engine vs trainer logprobs")

    ax = axes[1][1]
    ax.plot(*_series(rows, "time/step"), lw=1.2, color="tab:purple", label="step")
    ax.plot(*_series(rows, "time/train"), lw=1, color="tab:gray", label="train phase")
    ax.set_ylabel("seconds")
    ax.set_ylim(bottom=0)
    ax.set_title("Step time")
    ax.legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("optimizer step")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    fig.suptitle(f"GRPO run: {output_dir}", fontsize=10)
    path = path or os.path.join(output_dir, "reward_curve.png")
    save_figure(fig, path)
    return path
