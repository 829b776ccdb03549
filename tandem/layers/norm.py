"""RMSNorm with an optional fused residual add (computed as HF computes it)."""

from __future__ import annotations

import torch
from torch import nn

from tandem import batch_invariant
from tandem.kernels.rmsnorm_ref import fused_add_rms_norm_ref, rms_norm_ref


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # fused Triton kernel (one pass for add + norm); row-wise, so batch-invariant on any shape
        if (x.is_cuda and x.dim() == 2) or batch_invariant.is_enabled():
            from tandem.kernels.rmsnorm import fused_add_rms_norm, rms_norm

            if residual is None:
                return rms_norm(x, self.weight, self.eps)
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return rms_norm_ref(x, self.weight, self.eps)
        return fused_add_rms_norm_ref(x, residual, self.weight, self.eps)
