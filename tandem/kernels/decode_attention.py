"""Triton paged decode attention: one query per sequence, grouped-query heads, split-KV.

Reference: `attention_ref.paged_attention_ref` with one query per sequence. Stage 1 runs one
program per (sequence, kv head, split): it loads each key/value tile once for all query heads of
the group (a tl.dot over the group, padded to 16 rows) and writes a partial output and its
log-sum-exp. Stage 2 merges the splits. The number of splits depends on shapes only, never on
device values, so the launch can be captured in a CUDA graph and replayed with any seq_lens. It is
a runtime argument: a new split count needs no recompilation.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["num_splits"])  # one compiled variant for every split count
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, seq_lens_ptr, block_tables_ptr,
    mid_out_ptr, mid_lse_ptr,
    qk_scale, num_splits,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    # Each split takes an equal share of this sequence's keys, rounded up to whole tiles;
    # splits past the end get none and write a neutral result (lse = -inf, out = 0).
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < GROUP
    head = kv_head * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    seq64 = seq.to(tl.int64)
    q_offs = seq64 * stride_qb + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    bt_row = block_tables_ptr + seq64 * stride_bt
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        phys = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_block = offs_n % BLOCK_SIZE
        k_offs = phys[None, :] * stride_kb + in_block[None, :] * stride_ks + offs_d[:, None]
        v_offs = phys[:, None] * stride_vb + in_block[:, None] * stride_vs + offs_d[None, :]
        k = tl.load(k_base + k_offs, mask=d_mask[:, None] & n_mask[None, :], other=0.0)  # [D, N]
        v = tl.load(v_base + v_offs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)  # [N, D]
        s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale  # [G, N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    has_keys = l_i > 0.0
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse_offs = seq64 * stride_lb + head * stride_lh + split
    tl.store(mid_lse_ptr + lse_offs, lse, mask=g_mask)
    mid_offs = seq64 * stride_mb + head * stride_mh + split * stride_ms
    tl.store(mid_out_ptr + mid_offs[:, None] + offs_d[None, :], out,
             mask=g_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    mid_out_ptr, mid_lse_ptr, out_ptr, num_splits,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    lse_offs = seq * stride_lb + head * stride_lh + offs_s
    lse = tl.load(mid_lse_ptr + lse_offs, mask=s_mask, other=float("-inf"))  # [S], log2 domain
    base = seq * stride_mb + head * stride_mh + offs_s * stride_ms
    part = tl.load(mid_out_ptr + base[:, None] + offs_d[None, :],
                   mask=s_mask[:, None] & d_mask[None, :], other=0.0)  # [S, D]
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # no keys at all (seq_len 0): output zeros
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(
    batch: int, num_kv_heads: int, max_context: int, device: torch.device
) -> int:
    """Enough splits to give every SM a few programs, but no split shorter than 256 keys."""
    programs = max(1, batch * num_kv_heads)
    want = triton.cdiv(4 * _num_sms(device), programs)
    return max(1, min(want, triton.cdiv(max_context, 256), 16))


def decode_attention(
    q_BNH: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence, q [B, N, H], over its seq_lens[b] cached keys.

    `num_splits` defaults to a value computed from shapes (B, kv heads, block_tables width), so
    the same launch is valid for every seq_lens <= block_tables.shape[1] * block_size.
    """
    batch, num_heads, head_dim = q_BNH.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.shape[3] == head_dim and v_cache.shape == k_cache.shape
    assert seq_lens.shape == (batch,) and block_tables.shape[0] == batch
    assert num_heads % num_kv_heads == 0, f"{num_heads=} must be a multiple of {num_kv_heads=}"
    assert block_size & (block_size - 1) == 0, f"block_size ({block_size}) must be a power of two"
    assert q_BNH.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    out = torch.empty(q_BNH.shape, dtype=q_BNH.dtype, device=q_BNH.device)  # contiguous
    if batch == 0:
        return out
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size
        num_splits = default_num_splits(batch, num_kv_heads, max_context, q_BNH.device)
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    fp32 = q_BNH.dtype == torch.float32
    block_n = 32 if fp32 else 64

    mid_out = torch.empty(batch, num_heads, num_splits, head_dim,
                          dtype=torch.float32, device=q_BNH.device)
    mid_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q_BNH.device)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q_BNH, k_cache, v_cache, seq_lens, block_tables,
        mid_out, mid_lse,
        scale * LOG2E, num_splits,
        q_BNH.stride(0), q_BNH.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_PRECISION="ieee" if fp32 else "tf32",
        num_warps=4,
        num_stages=2,
    )
    _decode_merge_kernel[(batch, num_heads)](
        mid_out, mid_lse, out, num_splits,
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=block_d,
        num_warps=4,
    )
    return out
