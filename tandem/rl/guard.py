"""The non-finite step guard: a step whose loss or gradient norm is not finite never reaches the
weights.

Such a step is skipped (no optimizer or scheduler step; its gradients are dropped), counted as
`train/nonfinite_steps`, and training goes on. Several in a row mean the run cannot learn: it stops
with an error naming the step, the first non-finite tensor found and what to try. Without the
guard, one NaN gradient norm makes gradient clipping scale every gradient by NaN, AdamW writes NaN
into every weight, and the run goes on generating from a broken model.
"""

from __future__ import annotations

import math
import warnings

import torch


class NonFiniteStepError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient norm."""


class NonFiniteGuard:
    def __init__(self, max_consecutive: int):
        if max_consecutive < 1:
            raise ValueError(f"max_consecutive_nonfinite_steps must be >= 1, got {max_consecutive}")
        self.max_consecutive = max_consecutive
        self.total = 0  # skipped steps over the run
        self.consecutive = 0
        self.warned_dropped = False

    def allow_step(self, step: int, finite: bool, first_bad: str | None, hint: str) -> bool:
        """Whether optimizer step `step` may touch the weights; raises after too many in a row."""
        if finite:
            self.consecutive = 0
            return True
        self.total += 1
        self.consecutive += 1
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteStepError(
                f"training stopped at step {step}: {self.consecutive} optimizer steps in a row had a "
                f"non-finite loss or gradient norm and were skipped. First non-finite tensor of the "
                f"last one: {first_bad or 'unknown'}. Try {hint}"
            )
        return False


    def warn_if_dropped_wholesale(self, step: int, metrics: dict, is_mode: str) -> None:
        """Once a run: the engine/trainer IS correction zeroing most of a rollout means that
        rollout taught (almost) nothing."""
        frac = metrics.get("sampling/is_dropped_fraction")
        if frac is None or frac < 0.5 or self.warned_dropped:
            return
        self.warned_dropped = True
        warnings.warn(
            f"step {step}: the importance-sampling correction ({is_mode}) masked or weighted below "
            f"1e-3 {frac:.0%} of this rollout, so it barely contributes to learning; mean |engine - "
            f"trainer logprob| is {metrics.get('sampling/sampling_logp_difference/mean', float('nan')):.3f}. "
            "The engine and the trainer disagree on the sampling distribution (check that both see "
            "the same weights, dtype and sampling parameters), or widen vllm_importance_sampling_clip_max.",
            stacklevel=3,
        )


def nonfinite_hint(args, bf16: bool) -> str:
    hint = f"a lower learning_rate (now {args.learning_rate:g})"
    if bf16:
        hint += ", bf16=False (fp32) to tell a precision problem from an unstable run"
    return hint + ", or check the reward functions for inf/NaN."


def is_finite(x: float | torch.Tensor) -> bool:
    return math.isfinite(float(x))


def first_nonfinite_grad(model: torch.nn.Module) -> str | None:
    """The name of the first parameter (in model order) whose gradient holds a NaN or an inf."""
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        g = g.to_local() if hasattr(g, "to_local") else g  # an FSDP shard
        bad = int((~torch.isfinite(g)).sum())
        if bad:
            return f"the gradient of {name} ({bad} of {g.numel()} values)"
    return None
