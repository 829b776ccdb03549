"""Triton kernel writing this step's keys and values into the paged KV cache.

Reference: `attention_ref.store_kvcache_ref`. Token t goes to slot slot_mapping[t], i.e. block
slot // block_size, offset slot % block_size; slot -1 (CUDA-graph padding) is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    t64 = t.to(tl.int64)
    k = tl.load(k_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    dst_offs = dst + offs_h[:, None] * stride_ch + offs_d[None, :]
    tl.store(k_cache_ptr + dst_offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst_offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(
    k_TNH: torch.Tensor,
    v_TNH: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k/v [T, Nkv, H] into caches [num_blocks, block_size, Nkv, H] at slot_mapping [T]."""
    T, nkv, hd = k_TNH.shape
    if T == 0:
        return
    assert v_TNH.shape == k_TNH.shape and slot_mapping.shape == (T,)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (nkv, hd)
    assert k_cache.stride() == v_cache.stride(), "k_cache and v_cache must share a layout"
    assert k_TNH.stride(-1) == 1 and v_TNH.stride(-1) == 1 and k_cache.stride(-1) == 1
    _store_kvcache_kernel[(T,)](
        k_TNH, v_TNH, k_cache, v_cache, slot_mapping,
        k_TNH.stride(0), k_TNH.stride(1), v_TNH.stride(0), v_TNH.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=nkv,
        HEAD_DIM=hd,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(nkv),
        BLOCK_D=triton.next_power_of_2(hd),
    )
