"""Torch references of `rmsnorm`'s kernels (HF's RMSNorm): the spec they are tested against."""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalise in fp32, cast back to the activation dtype, then scale."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    x = x + residual  # in the activation dtype, as HF's decoder layer adds
    return rms_norm_ref(x, weight, eps), x


def rms_norm_backward_ref(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) of `rms_norm_ref` by autograd, dy cast to its output dtype as autocast's cast
    would hand it back."""
    x = x.detach().requires_grad_(True)
    weight = weight.detach().requires_grad_(True)
    out = rms_norm_ref(x, weight, eps)
    return torch.autograd.grad(out, (x, weight), dy.to(out.dtype))
