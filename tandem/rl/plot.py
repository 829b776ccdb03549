"""The reward curve of a run, from its metrics.jsonl, as a PNG."""

from __future__ import annotations

import json
import os


def plot_reward_curve(output_dir: str, path: str | None = None) -> str | None:
    metrics = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.isfile(metrics):
        return None
    from tandem.bench.report import pyplot, save_figure

    plt = pyplot()
    rows = [json.loads(line) for line in open(metrics) if line.strip()]
    steps = [r["step"] for r in rows if r.get("reward") is not None]
    rewards = [r["reward"] for r in rows if r.get("reward") is not None]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, rewards, marker="o", lw=1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward of the rollouts")
    ax.set_title("GRPO reward")
    ax.grid(alpha=0.3)
    path = path or os.path.join(output_dir, "reward_curve.png")
    save_figure(fig, path)
    return path
