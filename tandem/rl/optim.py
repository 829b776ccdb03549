"""The optimizer and learning-rate schedule a GRPOConfig names (`optim`, `optim_offload`,
`lr_scheduler_type`, warm-up), as transformers' Trainer builds them, and the device memory each
optimizer's state takes (for the memory plan); `GRPOTrainer(optimizers=...)` replaces either.

Lighter state through well-kept libraries, under transformers' names: torchao's AdamW8bit and
AdamW4bit (`adamw_torch_8bit`, `adamw_torch_4bit`: block-quantised moments, pure PyTorch through
torch.compile) and bitsandbytes' (`adamw_bnb_8bit`, `paged_adamw_8bit`) where it is installed.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterable

import torch

from tandem.rl.config import GRPOConfig

ADAMW_32BIT = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw")  # torch.optim.AdamW
FOREACH_TEMPORARY = ("adamw_torch", "adamw_hf", "adamw", "adagrad", "rmsprop")  # a sqrt of a state
# name -> (pip package, import name, bytes of one quantised moment per element, block, min elements)
QUANTISED = {
    "adamw_torch_8bit": ("torchao", "torchao", 1.0, 256, 4096),
    "adamw_torch_4bit": ("torchao", "torchao", 0.5, 128, 4096),
    "adamw_bnb_8bit": ("bitsandbytes", "bitsandbytes", 1.0, 256, 4096),
    "adamw_8bit": ("bitsandbytes", "bitsandbytes", 1.0, 256, 4096),
    "paged_adamw_8bit": ("bitsandbytes", "bitsandbytes", 1.0, 256, 4096),
}


def build_optimizer(model: torch.nn.Module, a: GRPOConfig, device: torch.device,
                    offload: bool | None = None) -> torch.optim.Optimizer:
    """Over the trainable parameters only (with LoRA: the adapter). `offload` (the memory plan's
    choice; default `a.optim_offload`): AdamW's state and step in host memory (`offload.py`)."""
    params = [p for p in model.parameters() if p.requires_grad]
    offload = bool(a.optim_offload) if offload is None else offload
    adam = dict(lr=a.learning_rate, betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_epsilon,
                weight_decay=a.weight_decay)
    if offload:
        from tandem.rl.offload import HostOffloadAdamW

        return HostOffloadAdamW(params, **adam)
    if a.optim == "sgd":
        return torch.optim.SGD(params, lr=a.learning_rate, weight_decay=a.weight_decay)
    if a.optim == "adagrad":
        return torch.optim.Adagrad(params, lr=a.learning_rate, weight_decay=a.weight_decay)
    if a.optim == "rmsprop":
        return torch.optim.RMSprop(params, lr=a.learning_rate, weight_decay=a.weight_decay)
    if a.optim in QUANTISED:
        return _quantised(a.optim, params, adam)
    fused = {"fused": True} if a.optim == "adamw_torch_fused" and device.type == "cuda" else {}
    return torch.optim.AdamW(params, **adam, **fused)


def _quantised(name: str, params, adam: dict) -> torch.optim.Optimizer:
    check_installed(name)
    if name in ("adamw_torch_8bit", "adamw_torch_4bit"):
        from torchao.optim import AdamW4bit, AdamW8bit

        return (AdamW8bit if name == "adamw_torch_8bit" else AdamW4bit)(params, **adam)
    import bitsandbytes as bnb

    cls = bnb.optim.PagedAdamW8bit if name == "paged_adamw_8bit" else bnb.optim.AdamW8bit
    return cls(params, **adam)


def check_installed(name: str) -> None:
    """A quantised optimizer's library is importable, or a ValueError saying how to get it."""
    if name in QUANTISED:
        package, module, *_ = QUANTISED[name]
        if importlib.util.find_spec(module) is None:
            extra = " (pip install 'tandem[optim]')" if package == "torchao" else ""
            raise ValueError(f"optim={name!r} needs {package}: pip install {package}{extra}")


def state_bytes(optim: str, numels: Iterable[int]) -> int:
    """Bytes of the optimizer's state for trainable tensors of these sizes, once allocated (at
    the first step). AdamW keeps two fp32 moments (8 B an element); the quantised ones keep each
    moment in blocks of 1 or 0.5 B an element plus an fp32 scale a block, for tensors of at least
    4096 elements that divide into blocks (smaller ones in fp32, as torchao and bitsandbytes do)."""
    numels = list(numels)
    if optim == "sgd":
        return 0  # momentum 0: no state
    if optim in ("adagrad", "rmsprop"):
        return 4 * sum(numels)  # the sum / the square average
    if optim in QUANTISED:
        _, _, per, block, smallest = QUANTISED[optim]
        total = 0.0
        for n in numels:
            quantised = n >= smallest and n % block == 0
            total += 2 * (per * n + 4 * n / block) if quantised else 8 * n
        return int(math.ceil(total))
    return 8 * sum(numels)


def step_temporaries(optim: str, numels: Iterable[int], cuda: bool, weight_decay: float = 0.0) -> int:
    """Device bytes the optimizer step allocates and frees. On CUDA torch's foreach (multi-tensor)
    path takes the square root of a whole state list at once (4 B an element: the OOM of a 7B
    model's first `_multi_tensor_adam`), and SGD with weight decay a decayed copy of the
    gradients; on a CPU torch steps one tensor at a time. The fused kernels take nothing;
    torchao's compiled step works one tensor at a time: the largest's two moments in fp32 between
    dequantising and requantising them (8 B an element); the 4-bit step also holds each moment's
    int64 codes before it packs two to a byte (16 B more: on the H200 a 14B model's first 4-bit
    step ran out of memory with at least 24 B per element of its embedding held)."""
    numels = list(numels)
    if not numels:
        return 0
    if optim in QUANTISED:
        return (24 if optim == "adamw_torch_4bit" else 8) * max(numels)
    fused = optim == "adamw_torch_fused" and cuda
    if fused or optim == "sgd" and not weight_decay:
        return 0
    if optim in FOREACH_TEMPORARY + ("adamw_torch_fused", "sgd"):
        return 4 * (sum(numels) if cuda else max(numels))
    return 0


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
