"""Triton rotary embedding as HF's `apply_rotary_pos_emb` computes it for training: q and k of one
token in one program, forward and backward, with the reference beside it (`rotary_ref`).

Unlike the engine's `rotary` (in place, cos/sin looked up in a cache by position), this takes
per-token cos/sin [B, L, H] as HF's rotary embedding hands them to the attention, so packed rows
whose position ids restart (padding-free training) need nothing special, and it is out of place:
q [B, L, N, H] (the projection's view) in, [B, N, L, H] (HF's layout after its transpose) out.

Rounded as HF's torch ops are: each product and the sum in `compute` = the promoted dtype of q
and cos (fp32 under autocast over fp32 weights: cos/sin are fp32, q bf16), then cast to the
output dtype. The backward rounds as autograd does: each of the two paths' gradients to q's
dtype, then their sum.

Shapes: B rows, L tokens a row, N query heads, K key heads, H head dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.rmsnorm import TL_DTYPES
from tandem.kernels.rotary_ref import apply_rotary_pos_emb_ref  # noqa: F401 (the reference)


@triton.jit
def _rotate(x_ptr, sx_h, o_ptr, so_h, c1, c2, s1, s2, NUM_HEADS,
            HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr,
            BACKWARD: tl.constexpr, COMPUTE: tl.constexpr, GRAD: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_HEADS)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HALF)
    src = x_ptr + offs_h[:, None] * sx_h + offs_d[None, :]
    dst = o_ptr + offs_h[:, None] * so_h + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # x is the output's gradient: dq = g * cos + rotate_half^T(g * sin)
        o1 = ((x1 * c1).to(COMPUTE).to(GRAD).to(tl.float32)
              + (x2 * s2).to(COMPUTE).to(GRAD).to(tl.float32)).to(GRAD)
        o2 = ((x2 * c2).to(COMPUTE).to(GRAD).to(tl.float32)
              - (x1 * s1).to(COMPUTE).to(GRAD).to(tl.float32)).to(GRAD)
    else:  # q * cos + rotate_half(q) * sin, rotate_half(q) = [-q2, q1]
        o1 = ((x1 * c1).to(COMPUTE).to(tl.float32) - (x2 * s1).to(COMPUTE).to(tl.float32)).to(COMPUTE)
        o2 = ((x2 * c2).to(COMPUTE).to(tl.float32) + (x1 * s2).to(COMPUTE).to(tl.float32)).to(COMPUTE)
    out_ty = o_ptr.dtype.element_ty
    tl.store(dst, o1.to(out_ty), mask=mask)
    tl.store(dst + HALF, o2.to(out_ty), mask=mask)


@triton.jit
def _rotary_qk_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr,
    L, NUM_Q, NUM_K,
    sq_b, sq_l, sq_h, sk_b, sk_l, sk_h, sc_b, sc_l,
    sqo_b, sqo_l, sqo_h, sko_b, sko_l, sko_h,
    HALF: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BACKWARD: tl.constexpr,
    COMPUTE: tl.constexpr,
    GRAD: tl.constexpr,
):
    """One token (b, l): all its query and key heads, through its own cos/sin."""
    tok = tl.program_id(0).to(tl.int64)
    b = tok // L
    l = tok % L
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    c = cos_ptr + b * sc_b + l * sc_l + offs_d
    s = sin_ptr + b * sc_b + l * sc_l + offs_d
    c1 = tl.load(c, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(c + HALF, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(s, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(s + HALF, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    _rotate(q_ptr + b * sq_b + l * sq_l, sq_h, qo_ptr + b * sqo_b + l * sqo_l, sqo_h,
            c1, c2, s1, s2, NUM_Q, HALF, BLOCK_Q, BLOCK_HALF, BACKWARD, COMPUTE, GRAD)
    _rotate(k_ptr + b * sk_b + l * sk_l, sk_h, ko_ptr + b * sko_b + l * sko_l, sko_h,
            c1, c2, s1, s2, NUM_K, HALF, BLOCK_K, BLOCK_HALF, BACKWARD, COMPUTE, GRAD)


def _launch(q, k, cos, sin, q_out, k_out, q_dims, out_dims, backward: bool, grad_dtype) -> None:
    """q/k and q_out/k_out are 4-d; `q_dims` / `out_dims` name which of their dims are (b, l,
    head); `grad_dtype` is the forward's q dtype."""
    B, L, H = q.shape[q_dims[0]], q.shape[q_dims[1]], q.shape[3]
    assert cos.shape[0] in (1, B) and cos.shape[1] == L, f"cos {tuple(cos.shape)} for {B} rows of {L}"
    half = H // 2
    num_q, num_k = q.shape[q_dims[2]], k.shape[q_dims[2]]
    if B * L == 0:
        return

    def strides(t, dims):
        return [t.stride(d) for d in dims]

    sc_b = cos.stride(0) if cos.shape[0] > 1 else 0  # one row of cos/sin for every row: broadcast
    _rotary_qk_kernel[(B * L,)](
        q, k, cos, sin, q_out, k_out,
        L, num_q, num_k,
        *strides(q, q_dims), *strides(k, q_dims), sc_b, cos.stride(1),
        *strides(q_out, out_dims), *strides(k_out, out_dims),
        HALF=half,
        BLOCK_Q=triton.next_power_of_2(num_q),
        BLOCK_K=triton.next_power_of_2(num_k),
        BLOCK_HALF=triton.next_power_of_2(half),
        BACKWARD=backward,
        COMPUTE=TL_DTYPES[torch.promote_types(grad_dtype, cos.dtype)],  # q's and cos's
        GRAD=TL_DTYPES[grad_dtype],
        num_warps=4,
        enable_fp_fusion=False,  # no multiply-add contraction: fp32 rounds as torch does
    )


def _check(q, k, cos, sin) -> None:
    assert q.dim() == 4 and k.dim() == 4 and cos.dim() == 3, f"{q.shape=} {k.shape=} {cos.shape=}"
    assert cos.shape == sin.shape and cos.stride() == sin.stride() and cos.stride(-1) == 1
    assert q.shape[-1] == k.shape[-1] == cos.shape[-1] and q.shape[-1] % 2 == 0, "head dims differ or are odd"
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "q and k need a contiguous last dim"


def rotary_qk(q_BLNH: torch.Tensor, k_BLKH: torch.Tensor, cos_BLH: torch.Tensor, sin_BLH: torch.Tensor,
              out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_embed [B, N, L, H], k_embed [B, K, L, H]) of HF's `apply_rotary_pos_emb` on the
    transposed q and k, in `out_dtype` (default: q's and cos's promoted dtype, HF's)."""
    _check(q_BLNH, k_BLKH, cos_BLH, sin_BLH)
    B, L, N, H = q_BLNH.shape
    out_dtype = out_dtype or torch.promote_types(q_BLNH.dtype, cos_BLH.dtype)
    q_out = torch.empty(B, N, L, H, dtype=out_dtype, device=q_BLNH.device)
    k_out = torch.empty(B, k_BLKH.shape[2], L, H, dtype=out_dtype, device=q_BLNH.device)
    _launch(q_BLNH, k_BLKH, cos_BLH, sin_BLH, q_out, k_out, (0, 1, 2), (0, 2, 1), False, q_BLNH.dtype)
    return q_out, k_out


def rotary_qk_backward(dq_BNLH: torch.Tensor, dk_BKLH: torch.Tensor, cos_BLH: torch.Tensor,
                       sin_BLH: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients [B, L, N, H] / [B, L, K, H] of `rotary_qk`'s inputs (of `dtype`, q's) given the
    outputs' gradients (any layout with a contiguous last dim)."""
    dq_BNLH = dq_BNLH if dq_BNLH.stride(-1) == 1 else dq_BNLH.contiguous()
    dk_BKLH = dk_BKLH if dk_BKLH.stride(-1) == 1 else dk_BKLH.contiguous()
    B, N, L, H = dq_BNLH.shape
    dq = torch.empty(B, L, N, H, dtype=dtype, device=dq_BNLH.device)
    dk = torch.empty(B, L, dk_BKLH.shape[1], H, dtype=dtype, device=dq_BNLH.device)
    _launch(dq_BNLH, dk_BKLH, cos_BLH, sin_BLH, dq, dk, (0, 2, 1), (0, 1, 2), True, dtype)
    return dq, dk
