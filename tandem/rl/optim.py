"""The optimizer and learning-rate schedule a GRPOConfig names (`optim`, `lr_scheduler_type`,
warm-up), as transformers' Trainer builds them; `GRPOTrainer(optimizers=...)` replaces either."""

from __future__ import annotations

import math

import torch

from tandem.rl.config import GRPOConfig


def build_optimizer(model: torch.nn.Module, a: GRPOConfig, device: torch.device) -> torch.optim.Optimizer:
    """Over the trainable parameters only (with LoRA: the adapter)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if a.optim == "sgd":
        return torch.optim.SGD(params, lr=a.learning_rate, weight_decay=a.weight_decay)
    if a.optim == "adagrad":
        return torch.optim.Adagrad(params, lr=a.learning_rate, weight_decay=a.weight_decay)
    if a.optim == "rmsprop":
        return torch.optim.RMSprop(params, lr=a.learning_rate, weight_decay=a.weight_decay)
    fused = {"fused": True} if a.optim == "adamw_torch_fused" and device.type == "cuda" else {}
    return torch.optim.AdamW(params, lr=a.learning_rate, betas=(a.adam_beta1, a.adam_beta2),
                             eps=a.adam_epsilon, weight_decay=a.weight_decay, **fused)


def warmup_steps(a: GRPOConfig, total_steps: int) -> int:
    """warmup_steps >= 1 counts steps; in (0, 1) it is a share, as transformers 5 reads it; 0 falls
    back to warmup_ratio."""
    if a.warmup_steps >= 1:
        return int(a.warmup_steps)
    return math.ceil((a.warmup_steps or a.warmup_ratio) * total_steps)


def build_scheduler(optimizer: torch.optim.Optimizer, a: GRPOConfig, total_steps: int):
    from transformers import get_scheduler

    return get_scheduler(a.lr_scheduler_type, optimizer, num_warmup_steps=warmup_steps(a, total_steps),
                         num_training_steps=total_steps, scheduler_specific_kwargs=a.lr_scheduler_kwargs or {})
