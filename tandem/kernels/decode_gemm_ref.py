"""Torch reference of `decode_gemm.linear`: what it computes, not the order it sums in."""

from __future__ import annotations

import torch


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]), accumulated in fp32 and rounded once to x's dtype."""
    out = x.float() @ weight.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
