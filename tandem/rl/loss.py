"""GRPO-family losses as small functions, with TRL's GRPOTrainer semantics.

Shape suffix legend: N = completions in the batch (prompts x num_generations), G = num_generations,
T = completion tokens (right-padded), S = 1 for sequence-level ratios else T. The per-token
log-probabilities the loss takes come from `tandem.rl.logprobs`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tandem.rl.config import GRPOConfig

_ADV_EPS = 1e-4  # TRL divides by (std + 1e-4)


# ---- advantages -------------------------------------------------------------------------------


def _nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Sample standard deviation (Bessel-corrected) ignoring NaNs; NaN where < 2 values."""
    if dim is None:
        x, dim = x.reshape(-1), 0
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    sq = torch.nan_to_num((x - mean) ** 2, nan=0.0).sum(dim=dim, keepdim=True)
    var = sq / (count - 1).clamp(min=1)
    var = torch.where(count > 1, var, torch.full_like(var, float("nan")))
    std = var.sqrt()
    return std if keepdim else std.squeeze(dim)


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group"
) -> torch.Tensor:
    """Group-relative advantages: reward minus its group's mean, optionally over a std.

    rewards [N] holds each prompt's G completions consecutively; NaN marks an unscorable completion,
    which is left out of its group's statistics and gets advantage 0.
    scale_rewards: "group" (std within the group), "batch" (std over the batch), "none".
    """
    if rewards.dim() != 1 or rewards.numel() % num_generations:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by num_generations ({num_generations}), "
            f"got shape {tuple(rewards.shape)}"
        )
    rewards = rewards.float()
    rewards_BG = rewards.view(-1, num_generations)  # [B, G]
    mean_N = torch.nanmean(rewards_BG, dim=1, keepdim=True).expand_as(rewards_BG).reshape(-1)
    advantages = rewards - mean_N  # [N]
    if scale_rewards == "group":
        std_N = _nanstd(rewards_BG, dim=1, keepdim=True).expand_as(rewards_BG).reshape(-1)
        advantages = advantages / (std_N + _ADV_EPS)
    elif scale_rewards == "batch":
        advantages = advantages / (_nanstd(rewards) + _ADV_EPS)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}")
    return torch.nan_to_num(advantages, nan=0.0)


def reward_metrics(rewards: torch.Tensor, num_generations: int) -> dict[str, float]:
    """Logged reward statistics: mean, std, and the fraction of groups with no spread."""
    std_B = _nanstd(rewards.float().view(-1, num_generations), dim=1)
    zero_std = torch.isclose(torch.nan_to_num(std_B, nan=0.0), torch.zeros_like(std_B))
    return {
        "reward": torch.nanmean(rewards.float()).item(),
        "reward_std": _nanstd(rewards.float()).item(),
        "frac_reward_zero_std": zero_std.float().mean().item(),
    }


# ---- loss terms -------------------------------------------------------------------------------


def log_importance_ratio(
    logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, level: str = "token"
) -> torch.Tensor:
    """log(pi / pi_old): per token [N, T], or per sequence [N, 1] as GSPO's length-mean."""
    log_ratio_NT = logp - old_logp
    if level == "token":
        return log_ratio_NT
    if level == "sequence":
        mask = mask.to(log_ratio_NT.dtype)
        return ((log_ratio_NT * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {level!r}")


def clipped_surrogate(
    log_ratio: torch.Tensor, advantages: torch.Tensor, epsilon_low: float, epsilon_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped objective, negated: -min(r A, clip(r, 1-eps_low, 1+eps_high) A).

    log_ratio [N, S], advantages [N]. Returns (per-token loss [N, S], ratio r [N, S]).
    """
    ratio_NS = torch.exp(log_ratio)
    adv_N1 = advantages[:, None].to(ratio_NS.dtype)  # [N, 1]
    clipped_NS = torch.clamp(ratio_NS, 1 - epsilon_low, 1 + epsilon_high)
    loss_NS = -torch.min(ratio_NS * adv_N1, clipped_NS * adv_N1)
    return loss_NS, ratio_NS


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref) per token: exp(d) - d - 1, d = ref - logp."""
    d_NT = ref_logp - logp
    return torch.exp(d_NT) - d_NT - 1


def importance_weights(
    old_logp: torch.Tensor,
    engine_logp: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "sequence_mask",
    clip_max: float | None = 3.0,
    clip_min: float | None = None,
) -> torch.Tensor:
    """Weights correcting for sampling by the engine instead of the trainer's policy (TRL's modes).

    The ratio is pi_old / pi_engine per token ("token_*", [N, T]) or its product over the
    sequence ("sequence_*", [N, 1]). "*_truncate" clamps it into [clip_min, clip_max];
    "*_mask" zeroes it outside that range.
    """
    level, _, how = mode.partition("_")
    if level not in ("token", "sequence") or how not in ("truncate", "mask"):
        raise ValueError(
            "mode must be 'token_truncate', 'token_mask', 'sequence_truncate' or 'sequence_mask', "
            f"got {mode!r}"
        )
    diff_NT = (old_logp - engine_logp) * mask.to(old_logp.dtype)
    log_w = diff_NT.sum(-1, keepdim=True) if level == "sequence" else diff_NT  # [N, S]
    weights_NS = torch.exp(log_w)
    if how == "truncate":
        if clip_min is None and clip_max is None:
            raise ValueError(f"{mode} needs clip_max or clip_min")
        return torch.clamp(weights_NS, min=clip_min, max=clip_max)
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    return weights_NS.masked_fill((weights_NS < lo) | (weights_NS > hi), 0.0)


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    max_completion_length: int | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
    num_micro_batches: int = 1,
    row_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce per-token losses [N, S] over mask [N, T] to the scalar to backprop, as TRL does.

    grpo:    mean over each sequence's tokens, then mean over sequences.
    bnpo:    sum over all tokens / tokens in this micro-batch.
    dr_grpo: sum over all tokens / (N * max_completion_length).
    dapo:    sum over all tokens / num_items_in_batch, the token count of the whole accumulated
             batch (every micro-batch, every process); without it, as bnpo.
    A trainer summing gradients over `num_micro_batches` micro-batches passes that count so the
    accumulated loss is their mean; dapo with num_items_in_batch is already global and ignores it.
    row_scale [N] (`step_row_scales`): each row's weight, the normalisation of the whole
    optimizer step already in it; the loss is then sum_i row_scale[i] x row i's token losses.
    """
    mask = mask.to(per_token_loss.dtype)
    masked_NT = per_token_loss * mask  # [N, T]
    if row_scale is not None:
        return (masked_NT.sum(-1) * row_scale.to(masked_NT.dtype)).sum()
    if loss_type == "grpo":
        loss = (masked_NT.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo" or (loss_type == "dapo" and num_items_in_batch is None):
        loss = masked_NT.sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        if not max_completion_length:
            raise ValueError("loss_type 'dr_grpo' needs max_completion_length")
        loss = masked_NT.sum() / (per_token_loss.shape[0] * max_completion_length)
    elif loss_type == "dapo":
        total = torch.as_tensor(num_items_in_batch, dtype=masked_NT.dtype, device=masked_NT.device)
        return masked_NT.sum() / total.clamp(min=1.0)
    else:
        raise ValueError(
            f"loss_type must be 'grpo', 'dapo', 'dr_grpo' or 'bnpo', got {loss_type!r}"
        )
    return loss / num_micro_batches


def step_row_scales(
    mask: torch.Tensor,
    loss_type: str,
    micro_batches: Sequence[slice],
    max_completion_length: int | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
    num_micro_batches: int | None = None,
) -> torch.Tensor:
    """`aggregate_loss`'s normalisation of one optimizer step, as a weight per row [R].

    mask [N, T]; `micro_batches`: the step's micro-batches of per_device_train_batch_size rows
    (R rows in all, in order), the ones the normalisation is defined over; `num_micro_batches`:
    their count over every process (default: len(micro_batches)). A micro-batch made of any of
    the step's rows then has loss sum_i scale[i] x row i's token losses, so however the rows are
    grouped (`micro_batches.py`), the step's loss and gradient are those of these micro-batches.
    """
    tokens_N = mask.sum(-1, dtype=mask.dtype if mask.is_floating_point() else torch.float32)  # [N]
    M = num_micro_batches or len(micro_batches)
    parts = []
    for s in micro_batches:
        tokens_B, B = tokens_N[s], tokens_N[s].numel()
        if loss_type == "grpo":
            scale_B = 1.0 / (tokens_B.clamp(min=1.0) * B * M)
        elif loss_type == "bnpo" or (loss_type == "dapo" and num_items_in_batch is None):
            scale_B = (1.0 / (tokens_B.sum().clamp(min=1.0) * M)).expand(B)
        elif loss_type == "dr_grpo":
            if not max_completion_length:
                raise ValueError("loss_type 'dr_grpo' needs max_completion_length")
            scale_B = tokens_B.new_full((B,), 1.0 / (B * max_completion_length * M))
        elif loss_type == "dapo":
            total = torch.as_tensor(num_items_in_batch, dtype=tokens_B.dtype, device=tokens_B.device)
            scale_B = (1.0 / total.clamp(min=1.0)).expand(B)
        else:
            raise ValueError(
                f"loss_type must be 'grpo', 'dapo', 'dr_grpo' or 'bnpo', got {loss_type!r}"
            )
        parts.append(scale_B)
    return torch.cat(parts)


# ---- the composed loss ------------------------------------------------------------------------


def _masked_stat(x: torch.Tensor, keep: torch.Tensor, stat: str) -> torch.Tensor:
    """min / mean / max of x where `keep` (broadcast to x) holds, NaN where nothing is kept:
    computed on the device, with no read-back to learn how many entries are kept."""
    keep = keep.expand_as(x)
    n = keep.sum()
    if stat == "mean":
        value = torch.where(keep, x, 0.0).sum() / n.clamp(min=1)
    else:
        masked = torch.where(keep, x, float("inf") if stat == "min" else float("-inf"))
        value = masked.amin() if stat == "min" else masked.amax()
    return torch.where(n > 0, value, float("nan"))


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over valid tokens for [N, T]; over sequences with a valid token for [N, 1]."""
    if x.shape[-1] == 1:
        seq_ok = mask.sum(-1, keepdim=True) > 0
        return (x * seq_ok).sum() / seq_ok.sum().clamp(min=1)
    return (x * mask).sum() / mask.sum().clamp(min=1)


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    importance_sampling_level: str = "token",
    beta: float = 0.0,
    ref_logp: torch.Tensor | None = None,
    engine_logp: torch.Tensor | None = None,
    is_mode: str = "sequence_mask",
    is_clip_max: float | None = 3.0,
    is_clip_min: float | None = None,
    max_completion_length: int | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
    num_micro_batches: int = 1,
    row_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO loss for one micro-batch, and its metrics (detached 0-d tensors, TRL's names).

    logp [N, T] carries gradients; old_logp [N, T] is the policy that sampled (None: on-policy,
    logp.detach()); advantages [N]; mask [N, T] marks completion tokens that count.
    engine_logp [N, T]: the engine's sampling logprobs, given when the engine-vs-trainer
    importance-sampling correction is on. ref_logp [N, T] is needed when beta > 0.
    row_scale [N]: the step-wide normalisation (`step_row_scales`), instead of the micro-batch's.
    """
    mask = mask.to(logp.dtype)
    old_logp = logp.detach() if old_logp is None else old_logp
    eps_high = epsilon_low if epsilon_high is None else epsilon_high

    log_ratio_NS = log_importance_ratio(logp, old_logp, mask, importance_sampling_level)
    loss_NS, ratio_NS = clipped_surrogate(log_ratio_NS, advantages, epsilon_low, eps_high)
    metrics: dict[str, torch.Tensor] = {}

    if engine_logp is not None:
        is_w_NS = importance_weights(
            old_logp.detach(), engine_logp, mask, is_mode, is_clip_max, is_clip_min
        )
        loss_NS = loss_NS * is_w_NS
        # sequences with no token that counts are not "masked"; NaN where nothing counts
        w, counted = is_w_NS.detach(), mask.bool()
        kept = (mask.sum(-1, keepdim=True) > 0) if w.shape[-1] == 1 else counted
        # The share of the rollout the correction threw away: masked, or weighted below 1e-3.
        metrics["sampling/is_dropped_fraction"] = _masked_stat((w < 1e-3).float(), kept, "mean")
        for stat in ("min", "mean", "max"):
            metrics[f"sampling/importance_sampling_ratio/{stat}"] = _masked_stat(w, kept, stat)
        delta = (old_logp.detach() - engine_logp).abs()
        for stat in ("mean", "max"):
            metrics[f"sampling/sampling_logp_difference/{stat}"] = _masked_stat(delta, counted, stat)

    if beta != 0.0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp, the reference model's per-token logprobs")
        kl_NT = kl_k3(logp, ref_logp)
        loss_NS = loss_NS + beta * kl_NT
        metrics["kl"] = _masked_mean(kl_NT.detach(), mask)

    loss = aggregate_loss(
        loss_NS, mask, loss_type, max_completion_length, num_items_in_batch, num_micro_batches,
        row_scale,
    )

    with torch.no_grad():
        adv_N1 = advantages[:, None]
        low = ((ratio_NS < 1 - epsilon_low) & (adv_N1 < 0)).to(mask.dtype)
        high = ((ratio_NS > 1 + eps_high) & (adv_N1 > 0)).to(mask.dtype)
        metrics["clip_ratio/low_mean"] = _masked_mean(low, mask)
        metrics["clip_ratio/high_mean"] = _masked_mean(high, mask)
        metrics["clip_ratio/region_mean"] = _masked_mean(torch.maximum(low, high), mask)
    return loss, metrics


def loss_kwargs_from_config(config: GRPOConfig) -> dict[str, Any]:
    """The keyword arguments of `grpo_loss` that a GRPOConfig fixes for a whole run."""
    return {
        "loss_type": config.loss_type,
        "epsilon_low": config.epsilon,
        "epsilon_high": config.epsilon_high,
        "importance_sampling_level": config.importance_sampling_level,
        "beta": config.beta,
        "is_mode": config.vllm_importance_sampling_mode,
        "is_clip_max": config.vllm_importance_sampling_clip_max,
        "is_clip_min": config.vllm_importance_sampling_clip_min,
        "max_completion_length": config.max_completion_length,
    }
