"""What a person watches while GRPO trains: a progress bar over the optimizer steps, a compact line
of a fixed set of figures every `logging_steps`, and sample completions as a small table. Every
metric still goes to metrics.jsonl and TensorBoard (logging.py); this is only the console."""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Sequence
from typing import TextIO

# The compact line's figures, in this order, when the step has them (docs/rl.md lists them):
# label -> metric key.
CONSOLE_KEYS = {
    "loss": "loss",
    "reward": "reward",  # the sum of the reward functions (each in [0, 1] for the built-in ones)
    "accuracy": "rewards/accuracy_reward/mean",  # this step's rollouts, not the held-out set
    "held-out": "eval/accuracy_reward/mean",
    "|Δlogp|": "sampling/sampling_logp_difference/mean",  # engine vs trainer, nats per token
    "kl": "kl",
    "clip": "clip_ratio/region_mean",
    "grad_norm": "grad_norm",
    "lr": "learning_rate",
    "len": "completions/mean_length",
    "s/step": "time/step",
}
_PERCENT = {"accuracy", "held-out"}
BAR_KEYS = ("reward", "accuracy", "held-out", "|Δlogp|")  # beside the bar's step, s/step and ETA


def fmt(v: float | None) -> str:
    if v is None:
        return "nan"
    return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.3e}"


def _figure(label: str, v: float | None) -> str:
    return f"{100 * v:.1f}%" if label in _PERCENT and v is not None else fmt(v)


def console_line(step: int, values: dict[str, float | None]) -> str:
    """`step    3 | loss 0.01 | reward 1.2 | accuracy 31.2% | ...`: the fixed figures only."""
    parts = [f"{label} {_figure(label, values[key])}" for label, key in CONSOLE_KEYS.items()
             if key in values]
    return f"step {step:>5} | " + " | ".join(parts)


def bar_postfix(values: dict[str, float | None]) -> str:
    return ", ".join(f"{label} {_figure(label, values[CONSOLE_KEYS[label]])}" for label in BAR_KEYS
                     if CONSOLE_KEYS[label] in values)


class TrainProgress:
    """A tqdm bar of optimizer steps with ETA; `enabled` None: only when `file` is a terminal."""

    def __init__(self, total: int, initial: int = 0, file: TextIO = sys.stderr,
                 enabled: bool | None = None) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, unit="step", desc="GRPO", file=file,
                        dynamic_ncols=True, disable=None if enabled is None else not enabled,
                        smoothing=0.3)
        self.values: dict[str, float | None] = {}

    def update(self, step: int, values: dict[str, float | None]) -> None:
        self.values.update(values)  # an evaluation's record keeps the last step's figures shown
        self.bar.set_postfix_str(bar_postfix(self.values), refresh=False)
        self.bar.update(max(0, step - self.bar.n))

    def close(self) -> None:
        self.bar.close()


def write(line: str, file: TextIO) -> None:
    """Print above a live bar without breaking it."""
    from tqdm import tqdm

    tqdm.write(line, file=file)


_MARKERS = re.compile(r"<\|[^|>]*\|>|</?s>")  # chat-template tokens: <|im_start|>, </s>, ...
_ROLE_AT_END = re.compile(r"\s*\b(assistant|model)\s*$", re.IGNORECASE)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _question(prompt: str) -> str:
    """A rendered chat prompt without its template's markers and the closing assistant turn."""
    return _ROLE_AT_END.sub("", _one_line(_MARKERS.sub(" ", prompt)))


def _tail(text: str, n: int) -> str:
    text = _question(text)
    return text if len(text) <= n else "…" + text[-(n - 1):]


def _head(text: str, n: int) -> str:
    text = _one_line(text)
    return text if len(text) <= n else text[: n - 1] + "…"


def completions_table(step: int, prompts: Sequence[str], completions: Sequence[str],
                      rewards: Sequence[float | None], advantages: Sequence[float | None],
                      total: int, width: int | None = None) -> str:
    """TRL's log_completions table, as text: reward, advantage, the prompt's end, the completion;
    `width` None: the terminal's (60 to 140 columns)."""
    if width is None:
        width = min(140, max(60, shutil.get_terminal_size((100, 24)).columns))
    p_w = (width - 21) * 2 // 5  # 21: the number columns and the gaps
    c_w = width - 21 - p_w
    lines = [f"step {step}: {len(prompts)} of {total} completions",
             f"{'reward':>7} {'advantage':>9}  {'prompt (its end)':<{p_w}}  completion"]
    for p, c, r, a in zip(prompts, completions, rewards, advantages):
        adv = f"{a:+.2f}" if a is not None else "-"
        lines.append(f"{fmt(r):>7} {adv:>9}  {_tail(p, p_w):<{p_w}}  {_head(c, c_w)}")
    return "\n".join(lines)
