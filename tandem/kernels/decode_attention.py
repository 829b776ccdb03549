"""Triton paged decode attention: one query per sequence, grouped-query heads, split-KV.

Reference: `attention_ref.paged_attention_ref` with one query per sequence. One program per
(kv-head block, split, sequence) streams its share of the sequence's keys in tiles of BLOCK_N.
A program serves `heads_kv` kv heads at once (both of Qwen2.5-1.5B's below 133 rows on an
H200: `decode_config`), so a tile is one contiguous run of `heads_kv * head_dim` elements per
token rather than one head's slice of it.
Their query heads are stacked block-diagonally, [heads_kv * group, heads_kv * head_dim], so one
tl.dot scores every query head against its own kv head (the zeros cost tensor-core work, which
decode has to spare; memory traffic is what counts).

With one split the program writes the final output. With several it writes a partial output and
its log-sum-exp, and the splits are merged: by a second kernel, or (`DecodeConfig.fused_merge`)
by the last of a sequence's splits to finish, in split order, as the decode GEMM's split-K sums
(a per-(sequence, kv block) counter says which is last): no second launch. The split count
depends on shapes only, never on device values, so the launch can be captured in a CUDA graph and
replayed with any seq_lens. It is a runtime argument: a new split count needs no recompilation.

`rotary_store_decode_attention` is the attention layer's decode step in one launch: each program
rotates its query heads in registers, and the program whose keys end at the step's new token
rotates that token's key and writes it and the value to the cache before its loop reads them
back (instead of `rotary.apply_rotary_and_store_kv`, then this kernel: one launch fewer per layer).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from tandem.kernels import pdl
from tandem.kernels.counters import MAX_COUNTERS, counters
from tandem.kernels.rotary import check_rotary_args

LOG2E = 1.4426950408889634
# Whether `decode_config` merges splits in the attention kernel (`DecodeConfig.fused_merge`):
# off until measured on the GPU; `TANDEM_FUSED_SPLIT_MERGE=1` turns it on (an A/B switch, read
# once at import, as `tandem.kernels.pdl`'s).
FUSED_MERGE = os.environ.get("TANDEM_FUSED_SPLIT_MERGE", "0") == "1"
# Whether the engine launches decode attention's sequences in `balanced_order` (by their lengths)
# rather than in batch order: on (H200, 2026-12-05: gen-1.5b-long's decode step 3.24-3.25 ->
# 3.17 ms, +2% tokens/s); `TANDEM_BALANCED_DECODE=0` turns it off (an A/B switch, read at import).
BALANCED_ORDER = os.environ.get("TANDEM_BALANCED_DECODE", "1") != "0"


@triton.jit
def _rope_table(ptr, mask, dtype: tl.constexpr):
    """A row of the fp32 cos or sin cache, rounded to the activation dtype as `.to(q.dtype)`."""
    return tl.load(ptr, mask=mask, other=0.0).to(dtype).to(tl.float32)


@triton.jit
def _rope(x, x_partner, cos, signed_sin):
    """x * cos + rotate_half(x) * sin, each product and the sum rounded to x's dtype as
    `tandem.kernels.rotary` (and three torch ops) round them."""
    dtype = x.dtype
    a = (x.to(tl.float32) * cos).to(dtype).to(tl.float32)
    b = (x_partner.to(tl.float32) * signed_sin).to(dtype).to(tl.float32)
    return (a + b).to(dtype)


@triton.jit
def _merge_splits(part_ptr, lse_rows, out_ptr, part_offs, out_offs, own, row_mask, num_splits,
                  stride_os, BLOCK_S: tl.constexpr):
    """The splits' partial outputs [M, C] (at part_offs + s * stride_os) weighted by their
    log2-sum-exps (at lse_rows + s) into the final output, in split order; what `_decode_merge_kernel`
    computes for each head, here for a program's heads at once. Read from L2 (.cg), where the
    other splits' programs wrote them."""
    offs_s = tl.arange(0, BLOCK_S)
    lse = tl.load(lse_rows[:, None] + offs_s[None, :],
                  mask=row_mask[:, None] & (offs_s < num_splits)[None, :], other=float("-inf"),
                  cache_modifier=".cg")  # [M, S]
    m = tl.max(lse, 1)
    m = tl.where(m == float("-inf"), 0.0, m)  # no keys at all (seq_len 0): output zeros
    w = tl.exp2(lse - m[:, None])
    denom = tl.sum(w, 1)
    acc = tl.zeros(own.shape, dtype=tl.float32)
    for split in range(num_splits):
        w_split = tl.sum(tl.where(offs_s[None, :] == split, w, 0.0), 1)
        part = tl.load(part_ptr + part_offs + split * stride_os, mask=own, other=0.0,
                       cache_modifier=".cg")
        acc += part * w_split[:, None]
    out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=own)


# One compiled variant for every split count and block-table width (eager steps size the table
# by their longest sequence; a graph's table is always full width).
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, seq_lens_ptr, block_tables_ptr, order_ptr,
    out_ptr, lse_ptr, final_ptr, count_ptr,
    new_k_ptr, new_v_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr,
    qk_scale, num_splits,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_fb, stride_fh,
    stride_nkb, stride_nkh, stride_nvb, stride_nvh, stride_cos,
    ROTARY: tl.constexpr,
    HALF: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_KV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PARTIAL: tl.constexpr,
    ORDERED: tl.constexpr,
    MERGE: tl.constexpr,
    BLOCK_S: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # launched early (tandem.kernels.pdl): wait for the previous kernel's writes
        gdc_wait()
    kv_block = tl.program_id(0)
    split = tl.program_id(1)
    if ORDERED:  # the sequence this row of programs takes (`balanced_order`)
        seq = tl.load(order_ptr + tl.program_id(2))
    else:
        seq = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    # Each split takes an equal share of this sequence's keys, rounded up to whole tiles;
    # splits past the end get none and write a neutral result (lse = -inf, out = 0).
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    # Rows: this program's query heads; columns: its kv heads' dims side by side.
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < HEADS_KV * GROUP
    head = kv_block * (HEADS_KV * GROUP) + rows
    cols = tl.arange(0, HEADS_KV * BLOCK_D)
    col_kv = cols // BLOCK_D
    col_d = cols % BLOCK_D
    if HEAD_DIM == BLOCK_D:
        col_mask = cols < HEADS_KV * BLOCK_D  # all true; keeps the loads vectorized
    else:
        col_mask = col_d < HEAD_DIM
    own = (rows[:, None] // GROUP == col_kv[None, :]) & row_mask[:, None] & col_mask[None, :]
    seq64 = seq.to(tl.int64)
    q_rows = q_ptr + seq64 * stride_qb + head[:, None] * stride_qh
    q = tl.load(q_rows + col_d[None, :], mask=own, other=0.0)  # [M, C] block-diagonal

    kv_head = kv_block * HEADS_KV + col_kv
    k_cols = kv_head * stride_kh + col_d  # [C]
    v_cols = kv_head * stride_vh + col_d
    if ROTARY:
        # Rotate q here, and let the program whose keys end at this step's token write its k
        # (rotated) and v to the cache before reading it back: `apply_rotary_and_store_kv` and
        # this kernel's attention in one launch, with the same numbers.
        partner = tl.where(col_d < HALF, col_d + HALF, col_d - HALF)
        sign = tl.where(col_d < HALF, -1.0, 1.0)
        pos = tl.load(pos_ptr + seq64).to(tl.int64)
        cos = _rope_table(cos_ptr + pos * stride_cos + col_d, col_mask, q_ptr.dtype.element_ty)
        sin = _rope_table(sin_ptr + pos * stride_cos + col_d, col_mask, q_ptr.dtype.element_ty)
        q_partner = tl.load(q_rows + partner[None, :], mask=own, other=0.0)
        q = _rope(q, q_partner, cos[None, :], sign * sin[None, :])
        last = seq_len - 1
        slot = tl.load(slot_ptr + seq64).to(tl.int64)
        if (start <= last) & (last < end) & (slot >= 0):
            k_row = new_k_ptr + seq64 * stride_nkb + kv_head * stride_nkh
            k_new = _rope(tl.load(k_row + col_d, mask=col_mask, other=0.0),
                          tl.load(k_row + partner, mask=col_mask, other=0.0), cos, sign * sin)
            v_new = tl.load(new_v_ptr + seq64 * stride_nvb + kv_head * stride_nvh + col_d,
                            mask=col_mask, other=0.0)
            page = slot // BLOCK_SIZE
            in_page = slot % BLOCK_SIZE
            tl.store(k_cache_ptr + page * stride_kb + in_page * stride_ks + k_cols,
                     k_new.to(k_cache_ptr.dtype.element_ty), mask=col_mask)
            tl.store(v_cache_ptr + page * stride_vb + in_page * stride_vs + v_cols,
                     v_new.to(v_cache_ptr.dtype.element_ty), mask=col_mask)
        tl.debug_barrier()  # the cache write is seen by every thread of the program's loads
    bt_row = block_tables_ptr + seq64 * stride_bt
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEADS_KV * BLOCK_D], dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        page = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_page = offs_n % BLOCK_SIZE
        # K and V tiles alike, a token per row ([N, C], contiguous rows); K transposed in the dot
        # (loaded as [C, N] instead, the tile streamed ~6% slower on the H200, same bits)
        kv_rows = n_mask[:, None] & col_mask[None, :]
        k_offs = (page * stride_kb + in_page * stride_ks)[:, None] + k_cols[None, :]
        v_offs = (page * stride_vb + in_page * stride_vs)[:, None] + v_cols[None, :]
        k = tl.load(k_cache_ptr + k_offs, mask=kv_rows, other=0.0)
        v = tl.load(v_cache_ptr + v_offs, mask=kv_rows, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale  # [M, N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                            input_precision=DOT_PRECISION)
        m_i = m_new

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]  # zeros where there are no keys
    out_offs = seq64 * stride_ob + head[:, None] * stride_oh + col_d[None, :]
    if PARTIAL:
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        lse_rows = lse_ptr + seq64 * stride_lb + head * stride_lh
        tl.store(lse_rows + split, lse, mask=row_mask)
        tl.store(out_ptr + out_offs + split * stride_os, out, mask=own)
        if MERGE:  # the last of this sequence's splits to finish merges them all
            tl.debug_barrier()  # every thread's partial is written before the counter moves
            count = count_ptr + seq64 * tl.num_programs(0) + kv_block
            arrived = tl.atomic_add(count, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                final_offs = seq64 * stride_fb + head[:, None] * stride_fh + col_d[None, :]
                _merge_splits(out_ptr, lse_rows, final_ptr, out_offs, final_offs, own, row_mask,
                              num_splits, stride_os, BLOCK_S)
                tl.atomic_xchg(count, 0)  # zero again for the next launch
    else:
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=own)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    mid_out_ptr, mid_lse_ptr, out_ptr, num_splits,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()
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


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters; `decode_config` picks them from shapes. Fields can be overridden."""

    heads_kv: int  # kv heads per program
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    fused_merge: bool = False  # splits merged by their last program (True) or a second kernel


def heads_per_program(num_kv_heads: int, head_dim: int) -> int:
    """As many kv heads per program as fit in a 256-element row (a power of two dividing K)."""
    n = 1
    while num_kv_heads % (2 * n) == 0 and 2 * n * triton.next_power_of_2(head_dim) <= 256:
        n *= 2
    return n


def decode_config(
    num_kv_heads: int, head_dim: int, dtype: torch.dtype, batch: int | None = None,
    device: torch.device | None = None,
) -> DecodeConfig:
    """Tiles of ~16 KB each of K and V. Five stages let Triton double-buffer the tiles *and*
    prefetch the block-table entries that address them (with fewer, the page lookup serialises
    every tile behind a full memory round trip).

    Given the batch, programs that pair two kv heads of 128 dims (Qwen2.5, Llama 3) pick their
    config by how many there are per SM, as measured on an H200 (`tandem.bench.kernels` and a
    sweep of the fused rotary kernel, bf16, Qwen2.5-1.5B, Qwen2.5-7B and Llama-3-8B heads, 64-256
    rows, 160-1536 keys, equal and random lengths; 2026-12-02):

    - more than two programs per SM: four stages (42 KB of shared memory a program against 75 KB
      at five): 1.27-1.36x with equal lengths at 512 programs (Qwen2.5-7B, 256 rows), 1.06-1.12x
      at 1024; 0.95-1.16x with random lengths (the slower at 1536 keys);
    - one to two per SM: one kv head per program, twice the programs (38 KB each): 0.98-1.24x;
    - fewer: the config above, whose splits of the keys (`default_num_splits`) fill the SMs
      (one kv head a program there was 0.88x at 1536 random keys, 1.35x at 160).
    """
    heads_kv = heads_per_program(num_kv_heads, head_dim)
    row = heads_kv * triton.next_power_of_2(head_dim)  # elements per token per tile
    tile_elems = 2048 if dtype == torch.float32 else 8192
    block_n = min(128, max(16, tile_elems // row))
    if batch is not None and heads_kv == 2 and head_dim == 128 and dtype != torch.float32:
        programs = batch * num_kv_heads // heads_kv
        sms = _num_sms(device if device is not None else torch.device("cpu"))  # (a CPU: the H200's)
        if programs > 2 * sms:
            return DecodeConfig(2, 32, num_warps=4, num_stages=4, fused_merge=FUSED_MERGE)
        if programs > sms:
            return DecodeConfig(1, 32, num_warps=4, num_stages=5, fused_merge=FUSED_MERGE)
    return DecodeConfig(heads_kv, block_n, num_warps=4, num_stages=5, fused_merge=FUSED_MERGE)


def default_num_splits(
    batch: int, num_kv_heads: int, max_context: int, device: torch.device, heads_kv: int = 1
) -> int:
    """Splits enough for about two programs per SM, each over at least 32 keys, at most 16.

    Measured on an H200 (`tandem.bench.kernels`, Qwen2.5-1.5B heads, bf16): with 256 programs one split
    is fastest at every context from 256 to 2048 keys (a second split only adds merge traffic);
    at 64 programs four splits win, at 16 programs eight.
    """
    programs = max(1, batch * (num_kv_heads // heads_kv))
    want = 2 * _num_sms(device) // programs
    return max(1, min(want, triton.cdiv(max_context, 32), 16))


def programs_per_sequence(batch: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                          max_context: int, device: torch.device) -> int:
    """A sequence's programs in the default launch (kv-head blocks x key splits)."""
    cfg = decode_config(num_kv_heads, head_dim, dtype, batch, device)
    splits = default_num_splits(batch, num_kv_heads, max_context, device, cfg.heads_kv)
    return num_kv_heads // cfg.heads_kv * splits


def balanced_order(seq_lens, programs_per_seq: int, num_sms: int) -> np.ndarray:
    """An order of the batch's sequences for the launch grid (`order=`), from their lengths on the
    host, so that the SMs get about the same number of keys.

    A launch places its programs on the SMs in turn, a sequence's programs side by side; in batch
    order (arrival) an SM may get several long sequences and the kernel waits on it while others
    idle. Here the longest come first, in rounds of as many sequences as one program an SM holds
    (num_sms // programs_per_seq), every other round reversed: the SM given the longest sequence
    of one round gets the shortest of the next. Only where programs run: the output is the same
    bits in any order. Returns int32 [B], a permutation of range(B)."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    ranked = np.argsort(-lens, kind="stable").astype(np.int32)
    per_round = max(1, num_sms // max(1, programs_per_seq))
    rounds = ranked[: len(ranked) // per_round * per_round].reshape(-1, per_round)
    rounds[1::2] = rounds[1::2, ::-1].copy()
    return np.concatenate([rounds.ravel(), ranked[rounds.size :][::-1] if len(rounds) % 2
                           else ranked[rounds.size :]])


def launch_order(seq_lens, batch: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 max_context: int, device: torch.device) -> np.ndarray:
    """`balanced_order` for the default launch of `batch` rows whose first len(seq_lens) are these
    sequences (the rest a CUDA graph's padding: no keys, last)."""
    lens = np.zeros(batch, dtype=np.int64)
    lens[: len(seq_lens)] = seq_lens
    per_seq = programs_per_sequence(batch, num_kv_heads, head_dim, dtype, max_context, device)
    return balanced_order(lens, per_seq, _num_sms(device))


def decode_attention(
    q_BNH: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence, q [B, N, H], over its seq_lens[b] cached keys.

    `num_splits` defaults to a value computed from shapes (B, kv heads, block_tables width), so
    the same launch is valid for every seq_lens <= block_tables.shape[1] * block_size. `order`
    (int32 [B] on the device, a permutation) is the sequence each row of the grid takes
    (`balanced_order`); it changes where programs run, not the output.
    """
    return _launch(q_BNH, k_cache, v_cache, seq_lens, block_tables, scale, num_splits, config,
                   order=order)


def rotary_store_decode_attention(
    positions: torch.Tensor,
    q_BNH: torch.Tensor,
    k_BKH: torch.Tensor,
    v_BKH: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """`apply_rotary_and_store_kv` of this step's q, k, v, then `decode_attention`, in one launch.

    One new token per sequence: k [B, K, H] and v are sequence b's token at positions[b], whose
    slot (slot_mapping[b]; -1 skips it) is the last of its seq_lens[b] keys. q and k are rotated
    in registers only (the inputs are left as they were); the output equals the two-kernel path's.
    """
    batch, _, head_dim = q_BNH.shape
    assert k_BKH.shape == v_BKH.shape == (batch, k_cache.shape[2], head_dim), (
        f"{k_BKH.shape=} {v_BKH.shape=}, expected ({batch}, {k_cache.shape[2]}, {head_dim})")
    assert k_BKH.dtype == v_BKH.dtype == q_BNH.dtype, f"{q_BNH.dtype=} {k_BKH.dtype=} {v_BKH.dtype=}"
    assert v_BKH.stride(-1) == 1, "v needs a contiguous last dim"
    check_rotary_args(q_BNH, k_BKH, cos_cache, sin_cache)  # one token per row, as the rotary's
    assert positions.shape == slot_mapping.shape == (batch,), (
        f"{positions.shape=} {slot_mapping.shape=}: one token per sequence ({batch})")
    new = (k_BKH, v_BKH, positions, cos_cache, sin_cache, slot_mapping)
    return _launch(q_BNH, k_cache, v_cache, seq_lens, block_tables, scale, num_splits, config, new,
                   order)


def _launch(q_BNH, k_cache, v_cache, seq_lens, block_tables, scale, num_splits, config,
            new=None, order=None) -> torch.Tensor:
    """`new` = (k, v, positions, cos_cache, sin_cache, slot_mapping): rotate and store first."""
    batch, num_heads, head_dim = q_BNH.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.shape[3] == head_dim and v_cache.shape == k_cache.shape
    assert seq_lens.shape == (batch,) and block_tables.shape[0] == batch
    assert order is None or (order.shape == (batch,) and order.dtype == torch.int32), (
        f"order must be int32 [{batch}], got {None if order is None else (order.dtype, tuple(order.shape))}")
    assert num_heads % num_kv_heads == 0, f"{num_heads=} must be a multiple of {num_kv_heads=}"
    assert block_size & (block_size - 1) == 0, f"block_size ({block_size}) must be a power of two"
    assert q_BNH.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    out = torch.empty(q_BNH.shape, dtype=q_BNH.dtype, device=q_BNH.device)  # contiguous
    if batch == 0:
        return out
    cfg = config or decode_config(num_kv_heads, head_dim, q_BNH.dtype, batch, q_BNH.device)
    assert num_kv_heads % cfg.heads_kv == 0, f"{cfg.heads_kv=} must divide {num_kv_heads=}"
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size
        num_splits = default_num_splits(
            batch, num_kv_heads, max_context, q_BNH.device, cfg.heads_kv
        )
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    fp32 = q_BNH.dtype == torch.float32
    partial = num_splits > 1
    merge_in_kernel = partial and cfg.fused_merge
    if partial:
        mid_out = torch.empty(batch, num_heads, num_splits, head_dim,
                              dtype=torch.float32, device=q_BNH.device)
        mid_lse = torch.empty(batch, num_heads, num_splits,
                              dtype=torch.float32, device=q_BNH.device)
        dst, dst_split_stride = mid_out, mid_out.stride(2)
    else:
        mid_lse = out  # unused
        dst, dst_split_stride = out, 0
    if merge_in_kernel:
        kv_blocks = num_kv_heads // cfg.heads_kv
        assert batch * kv_blocks <= MAX_COUNTERS, (
            f"{batch} sequences x {kv_blocks} kv blocks > {MAX_COUNTERS} split counters")
        seq_counts = counters(q_BNH.device, "decode_attention")
    else:
        seq_counts = seq_lens  # unused
    if new is None:  # placeholders the kernel never reads
        new_k, new_v, positions, cos_cache, sin_cache, slot_mapping = (q_BNH,) * 3 + (out,) * 3
        new_strides = (0, 0, 0, 0, 0)
    else:
        new_k, new_v, positions, cos_cache, sin_cache, slot_mapping = new
        new_strides = (*new_k.stride()[:2], *new_v.stride()[:2], cos_cache.stride(0))
    grid = (num_kv_heads // cfg.heads_kv, num_splits, batch)
    launch_pdl = pdl.enabled(q_BNH)
    _decode_kernel[grid](
        q_BNH, k_cache, v_cache, seq_lens, block_tables, order if order is not None else seq_lens,
        dst, mid_lse, out, seq_counts,
        new_k, new_v, positions, cos_cache, sin_cache, slot_mapping,
        scale * LOG2E, num_splits,
        q_BNH.stride(0), q_BNH.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        dst.stride(0), dst.stride(1), dst_split_stride,
        mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1),
        *new_strides,
        ROTARY=new is not None,
        HALF=head_dim // 2,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        HEADS_KV=cfg.heads_kv,
        BLOCK_M=max(16, triton.next_power_of_2(group * cfg.heads_kv)),
        BLOCK_N=cfg.block_n,
        BLOCK_D=block_d,
        PARTIAL=partial,
        ORDERED=order is not None,
        MERGE=merge_in_kernel,
        # one variant up to 16 splits (`default_num_splits`' most); unused without the merge
        BLOCK_S=max(16, triton.next_power_of_2(num_splits)) if merge_in_kernel else 1,
        DOT_PRECISION="ieee" if fp32 else "tf32",
        PDL=launch_pdl,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        launch_pdl=launch_pdl,
        # no multiply-add contraction, with the rotation in the kernel or not: the fused rotation
        # then rounds as `tandem.kernels.rotary` does (contracted, a rotated key differed by an ulp
        # on the H200), and both variants attend with the same arithmetic
        enable_fp_fusion=False,
    )
    if partial and not merge_in_kernel:
        _decode_merge_kernel[(batch, num_heads)](
            mid_out, mid_lse, out, num_splits,
            mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
            mid_lse.stride(0), mid_lse.stride(1),
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
            PDL=launch_pdl,
            num_warps=4,
            launch_pdl=launch_pdl,
        )
    return out
