"""Torch references of `activation`'s kernels: the spec the Triton kernels are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF's MLP activation: `act_fn(gate_proj(x)) * up_proj(x)` with act_fn SiLU."""
    return F.silu(gate) * up
