"""Torch reference of `rotary.apply_rotary` (HF's `apply_rotary_pos_emb`): the kernel's spec."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_ref(
    positions: torch.Tensor,
    q_TNH: torch.Tensor,
    k_TKH: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """New rotated (q, k), as HF's `apply_rotary_pos_emb`; cos/sin caches are [max_pos, H] fp32."""
    cos = cos_cache[positions].to(q_TNH.dtype)[:, None, :]
    sin = sin_cache[positions].to(q_TNH.dtype)[:, None, :]
    q = q_TNH * cos + rotate_half(q_TNH) * sin
    k = k_TKH * cos + rotate_half(k_TKH) * sin
    return q, k


def apply_rotary_pos_emb_ref(
    q_BNLH: torch.Tensor, k_BKLH: torch.Tensor, cos_BLH: torch.Tensor, sin_BLH: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's `apply_rotary_pos_emb` (unsqueeze_dim=1): per-token cos/sin, products in the promoted
    dtype; the spec of `rotary_train.rotary_qk`."""
    cos, sin = cos_BLH[:, None], sin_BLH[:, None]
    return q_BNLH * cos + rotate_half(q_BNLH) * sin, k_BKLH * cos + rotate_half(k_BKLH) * sin
