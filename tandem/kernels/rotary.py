"""Triton rotary embedding (neox / HF `rotate_half` style), in place on q and k, with its reference.

Rounded as `rotary_ref` computes it in torch: cos/sin are cast from the fp32 cache to
the activation dtype, and `q * cos`, `rotate_half(q) * sin` and their sum are each rounded to that
dtype. One program per token rotates all its query and key heads, so a decode step of the whole
batch is one launch with no host synchronisation (CUDA-graph capturable). The attention layers'
variant (`apply_rotary_and_store_kv`) also writes the rotated keys and the values into the paged
KV cache in the same program, sparing the cache-write kernel's launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.rotary_ref import apply_rotary_ref, rotate_half  # noqa: F401 (the reference)


@triton.jit
def _rotate_heads(x_ptr, stride_h, c1, c2, s1, s2, NUM_HEADS, HALF: tl.constexpr,
                  BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotates [NUM_HEADS, 2*HALF] at x_ptr in place; c1/s1 for the first half, c2/s2 the second."""
    offs_h = tl.arange(0, BLOCK_HEADS)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HALF)
    ptr1 = x_ptr + offs_h[:, None] * stride_h + offs_d[None, :]
    ptr2 = ptr1 + HALF
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr2, mask=mask, other=0.0)
    dtype = x1.dtype
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    # Each product and the sum rounded to the activation dtype, as three torch ops would.
    o1 = (x1f * c1).to(dtype).to(tl.float32) + (-x2f * s1).to(dtype).to(tl.float32)
    o2 = (x2f * c2).to(dtype).to(tl.float32) + (x1f * s2).to(dtype).to(tl.float32)
    tl.store(ptr1, o1.to(dtype), mask=mask)
    tl.store(ptr2, o2.to(dtype), mask=mask)
    return o1.to(dtype), o2.to(dtype), mask


@triton.jit
def _cache_half(ptr, mask, dtype: tl.constexpr):
    return tl.load(ptr, mask=mask, other=0.0).to(dtype).to(tl.float32)[None, :]


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cache,
    stride_cb, stride_cs, stride_ch,
    NUM_Q_HEADS, NUM_K_HEADS,
    HALF: tl.constexpr,
    STORE_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_K_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Rotates one token's q and k heads in place. With STORE_KV it also writes the rotated keys
    and the values to the token's cache slot (none for slot -1, a CUDA graph's padding): the
    attention layer's one launch instead of two. Without it v and the cache pointers are unused."""
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    cache_row = pos * stride_cache + offs_d
    dtype = q_ptr.dtype.element_ty
    # cos/sin rounded to the activation dtype first, as `.to(q.dtype)` does.
    c1 = _cache_half(cos_ptr + cache_row, d_mask, dtype)
    c2 = _cache_half(cos_ptr + cache_row + HALF, d_mask, dtype)
    s1 = _cache_half(sin_ptr + cache_row, d_mask, dtype)
    s2 = _cache_half(sin_ptr + cache_row + HALF, d_mask, dtype)
    _rotate_heads(q_ptr + tok * stride_qt, stride_qh, c1, c2, s1, s2, NUM_Q_HEADS,
                  HALF, BLOCK_Q_HEADS, BLOCK_HALF)
    k1, k2, mask = _rotate_heads(k_ptr + tok * stride_kt, stride_kh, c1, c2, s1, s2, NUM_K_HEADS,
                                 HALF, BLOCK_K_HEADS, BLOCK_HALF)
    if STORE_KV:
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        if slot >= 0:
            offs_h = tl.arange(0, BLOCK_K_HEADS)
            dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
            dst1 = dst + offs_h[:, None] * stride_ch + offs_d[None, :]
            cache_ty = k_cache_ptr.dtype.element_ty
            tl.store(k_cache_ptr + dst1, k1.to(cache_ty), mask=mask)
            tl.store(k_cache_ptr + dst1 + HALF, k2.to(cache_ty), mask=mask)
            src1 = v_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
            tl.store(v_cache_ptr + dst1, tl.load(src1, mask=mask).to(cache_ty), mask=mask)
            tl.store(v_cache_ptr + dst1 + HALF, tl.load(src1 + HALF, mask=mask).to(cache_ty), mask=mask)


def check_rotary_args(q_TNH, k_TKH, cos_cache, sin_cache) -> None:
    T, _, head_dim = q_TNH.shape
    assert k_TKH.shape[0] == T and k_TKH.shape[2] == head_dim, f"{q_TNH.shape=} {k_TKH.shape=}"
    assert head_dim % 2 == 0, f"head_dim ({head_dim}) must be even"
    assert q_TNH.dtype == k_TKH.dtype, f"{q_TNH.dtype=} != {k_TKH.dtype=}"
    assert q_TNH.stride(-1) == 1 and k_TKH.stride(-1) == 1, "q and k need a contiguous last dim"
    assert cos_cache.shape == sin_cache.shape and cos_cache.shape[1] == head_dim
    assert cos_cache.stride() == sin_cache.stride() and cos_cache.stride(1) == 1


def _launch(positions, q_TNH, k_TKH, cos_cache, sin_cache, kv=None) -> None:
    """One program per token; `kv` = (v, k_cache, v_cache, slot_mapping) writes the cache too."""
    T, num_q_heads, head_dim = q_TNH.shape
    if T == 0:
        return
    if kv is None:  # placeholders the kernel never reads
        v_TKH, k_cache, v_cache, slot_mapping = q_TNH, q_TNH, q_TNH, positions
        stride_v, stride_c, block_size = (0, 0), (0, 0, 0), 1
    else:
        v_TKH, k_cache, v_cache, slot_mapping = kv
        stride_v, stride_c, block_size = v_TKH.stride()[:2], k_cache.stride()[:3], k_cache.shape[1]
    half = head_dim // 2
    _rotary_kernel[(T,)](
        q_TNH, k_TKH, v_TKH, positions, cos_cache, sin_cache, k_cache, v_cache, slot_mapping,
        q_TNH.stride(0), q_TNH.stride(1), k_TKH.stride(0), k_TKH.stride(1), *stride_v,
        cos_cache.stride(0), *stride_c,
        num_q_heads, k_TKH.shape[1],
        HALF=half,
        STORE_KV=kv is not None,
        BLOCK_SIZE=block_size,
        BLOCK_Q_HEADS=triton.next_power_of_2(num_q_heads),
        BLOCK_K_HEADS=triton.next_power_of_2(k_TKH.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=4,
        enable_fp_fusion=False,  # no multiply-add contraction: fp32 rounds as torch does too
    )


def apply_rotary(
    positions: torch.Tensor,
    q_TNH: torch.Tensor,
    k_TKH: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, N, H] and k [T, K, H] in place (views are fine) and returns them.

    positions [T] index the fp32 caches [max_pos, H]; the last dim of q and k must be contiguous.
    """
    check_rotary_args(q_TNH, k_TKH, cos_cache, sin_cache)
    _launch(positions, q_TNH, k_TKH, cos_cache, sin_cache)
    return q_TNH, k_TKH


def apply_rotary_and_store_kv(
    positions: torch.Tensor,
    q_TNH: torch.Tensor,
    k_TKH: torch.Tensor,
    v_TKH: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rotary`, then `store_kvcache` of the rotated k and of v, in one kernel.

    Caches are [num_blocks, block_size, Nkv, H]; slot_mapping [T] (-1: skip the token)."""
    check_rotary_args(q_TNH, k_TKH, cos_cache, sin_cache)
    assert v_TKH.shape == k_TKH.shape and v_TKH.stride(-1) == 1, f"{v_TKH.shape=} {k_TKH.shape=}"
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == k_TKH.shape[1:]
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert slot_mapping.shape == (q_TNH.shape[0],), f"{slot_mapping.shape=}, {q_TNH.shape[0]} tokens"
    _launch(positions, q_TNH, k_TKH, cos_cache, sin_cache, (v_TKH, k_cache, v_cache, slot_mapping))
    return q_TNH, k_TKH
