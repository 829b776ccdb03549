"""SiLU-and-multiply over a merged gate/up projection."""

from __future__ import annotations

import torch
from torch import nn

from tandem import batch_invariant
from tandem.kernels.activation_ref import silu_and_mul_ref


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda or batch_invariant.is_enabled():
            from tandem.kernels.activation import silu_and_mul

            return silu_and_mul(x)
        return silu_and_mul_ref(x)
