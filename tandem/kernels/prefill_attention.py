"""Triton varlen causal attention over the paged KV cache (prefill and chunked prefill).

Reference: `attention_ref.paged_attention_ref`. Every key, including this step's, is read from the
cache. One program handles one tile of rows of one (sequence, kv head): a row is a (query token,
query head of the kv head's group) pair, so each key tile is loaded once for the whole group.
Tiles are numbered across the batch and each program finds its sequence by binary search over
query_start_loc, so the grid depends on the step's shape only (CUDA graphs capture mixed steps).
Flash-attention online softmax in the exp2 domain, fp32 accumulation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _attn_tile(
    acc, l_i, m_i, q, pos_m,
    k_ptrs_base, v_ptrs_base, bt_row_ptr,
    start_n, kv_end, stride_ks, stride_kb, stride_vs, stride_vb, offs_d, d_mask, qk_scale,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    CAUSAL_MASK: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One key tile [start_n, start_n + BLOCK_N) folded into the running softmax state."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if CAUSAL_MASK:
        n_mask = offs_n < kv_end
        phys = tl.load(bt_row_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    else:
        phys = tl.load(bt_row_ptr + offs_n // BLOCK_SIZE).to(tl.int64)
    in_block = offs_n % BLOCK_SIZE
    # K is loaded transposed, [D, N], for q @ k^T.
    k_offs = phys[None, :] * stride_kb + in_block[None, :] * stride_ks + offs_d[:, None]
    v_offs = phys[:, None] * stride_vb + in_block[:, None] * stride_vs + offs_d[None, :]
    if CAUSAL_MASK:
        if EVEN_D:
            k = tl.load(k_ptrs_base + k_offs, mask=n_mask[None, :], other=0.0)
            v = tl.load(v_ptrs_base + v_offs, mask=n_mask[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs_base + k_offs, mask=d_mask[:, None] & n_mask[None, :], other=0.0)
            v = tl.load(v_ptrs_base + v_offs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    else:
        if EVEN_D:
            k = tl.load(k_ptrs_base + k_offs)
            v = tl.load(v_ptrs_base + v_offs)
        else:
            k = tl.load(k_ptrs_base + k_offs, mask=d_mask[:, None], other=0.0)
            v = tl.load(v_ptrs_base + v_offs, mask=d_mask[None, :], other=0.0)
    s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale
    if CAUSAL_MASK:
        visible = (offs_n[None, :] <= pos_m[:, None]) & n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning flat tile index `tile`: the last s with qsl[s] // BLOCK_Q + s <= tile.

    Sequence s's tiles are numbered from qsl[s] // BLOCK_Q + s on; that start grows with s, and the
    range up to the next sequence's start holds at least cdiv(q_len, BLOCK_Q) indices, so every
    tile of every sequence has an index below T // BLOCK_Q + num_seqs. Binary search, no host data.
    """
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# The block-table width and batch size change with every step: not specialized on, so they cost
# no compile mid-serving (Triton would otherwise split values 1, multiples of 16 and the rest).
@triton.jit(do_not_specialize=["stride_bt", "num_seqs"])
def _prefill_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    num_seqs, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = tile - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # tokens cached before this chunk: absolute position of query 0

    # Row r is query token q_tile * BLOCK_Q + r // GROUP of head kv_head * GROUP + r % GROUP.
    offs_r = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + offs_r // GROUP
    head = kv_head * GROUP + offs_r % GROUP
    row_mask = (offs_r < BLOCK_Q * GROUP) & (tok < q_len)
    pos_m = ctx_len + tok
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM

    tok64 = (q_start + tok).to(tl.int64)
    q_offs = tok64[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Keys before the tile's first query are visible to every row: no mask needed there.
    first_pos = ctx_len + q_tile * BLOCK_Q
    full_end = (first_pos // BLOCK_N) * BLOCK_N
    kv_end = tl.minimum(seq_len, first_pos + BLOCK_Q)
    for start_n in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _attn_tile(
            acc, l_i, m_i, q, pos_m, k_base, v_base, bt_row,
            start_n, kv_end, stride_ks, stride_kb, stride_vs, stride_vb, offs_d, d_mask, qk_scale,
            BLOCK_N, BLOCK_SIZE, False, EVEN_D, DOT_PRECISION,
        )
    for start_n in range(full_end, kv_end, BLOCK_N):
        acc, l_i, m_i = _attn_tile(
            acc, l_i, m_i, q, pos_m, k_base, v_base, bt_row,
            start_n, kv_end, stride_ks, stride_kb, stride_vs, stride_vb, offs_d, d_mask, qk_scale,
            BLOCK_N, BLOCK_SIZE, True, EVEN_D, DOT_PRECISION,
        )

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    o_offs = tok64[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & d_mask[None, :])


def _tile_config(dtype: torch.dtype, max_query_len: int, group: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for queries of at most `max_query_len` tokens with
    `group` query heads per KV head (a tile holds BLOCK_M // group positions of all of them)."""
    if dtype == torch.float32:  # tests only: keep shared memory modest
        block_m, block_n, num_warps = 64, 32, 4
    else:
        block_m, block_n, num_warps = 128, 64, 8
    block_m = max(16, min(block_m, triton.next_power_of_2(max_query_len * group)))
    if block_m <= 64:
        num_warps = 4
    return max(block_m, triton.next_power_of_2(group)), block_n, num_warps, 2


def tile_rows_classes(group: int, dtype: torch.dtype, max_query_len: int = 1 << 16) -> list[int]:
    """One longest-query length per distinct tile config (one compiled variant each), shortest
    first: what a warm-up must run so that no step compiles later."""
    seen, lens = set(), []
    for q_len in range(1, max_query_len + 1):
        config = _tile_config(dtype, q_len, group)
        if config not in seen:
            seen.add(config)
            lens.append(q_len)
        if q_len * group >= 128:  # the largest tile is reached
            break
    return lens


def prefill_attention(
    q_TNH: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of q [T, N, H] against the paged cache; returns [T, N, H].

    Sequence b's queries are q[query_start_loc[b]:query_start_loc[b+1]], the last tokens of its
    seq_lens[b] cached tokens. Only `max_query_len` is read on the host (it picks the tile), so
    there is no sync; it may overstate the longest query, and q may hold rows past the last
    sequence's queries (a CUDA graph's padding): those rows' outputs are left unwritten. The grid
    follows T and the batch size alone, so a captured graph serves any batch of its shape.
    """
    T, num_heads, head_dim = q_TNH.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.shape[3] == head_dim and v_cache.shape == k_cache.shape
    assert num_heads % num_kv_heads == 0, f"{num_heads=} must be a multiple of {num_kv_heads=}"
    assert block_size & (block_size - 1) == 0, f"block_size ({block_size}) must be a power of two"
    assert q_TNH.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    out = torch.empty(q_TNH.shape, dtype=q_TNH.dtype, device=q_TNH.device)  # contiguous
    batch = seq_lens.shape[0]
    if T == 0 or batch == 0 or max_query_len == 0:
        return out
    group = num_heads // num_kv_heads
    block_m, block_n, num_warps, num_stages = _tile_config(q_TNH.dtype, max_query_len, group)
    block_q = block_m // group
    grid = (T // block_q + batch, num_kv_heads)
    _prefill_attention_kernel[grid](
        q_TNH, k_cache, v_cache, out,
        query_start_loc, seq_lens, block_tables,
        batch, scale * LOG2E,
        q_TNH.stride(0), q_TNH.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim),
        EVEN_D=triton.next_power_of_2(head_dim) == head_dim,
        DOT_PRECISION="ieee" if q_TNH.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
