"""Torch reference of `grammar_mask.apply_token_bitmask_` (and the path where Triton is absent)."""

from __future__ import annotations

import torch


def apply_token_bitmask_ref(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits[rows] of the tokens whose bit is 0 become -inf (bit t of a row: token t allowed)."""
    V = logits.shape[1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :V]  # [R, V]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
