"""SiLU-and-multiply over a merged gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from tandem.kernels.activation import silu_and_mul

            return silu_and_mul(x)
        return silu_and_mul_ref(x)
