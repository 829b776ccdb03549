"""Triton sampling for the common case: temperature, Gumbel-max and the sampled token's logprob in
one read of the logits, with no [S, V] intermediate.

Row r draws token argmax_i(x_i / T_r + G_i), G_i = -log(E_i) with E_i ~ Exp(1), which is a draw
from softmax(x / T_r) (the exponential race of `tandem.layers.sampler`, in log space). Greedy rows
take argmax_i x_i (first index on ties, like torch.argmax). The noise of row r comes from Philox
keyed by `seeds[r]` and counted by column, so it depends on that seed alone: not on the batch
size, the row's position, or how the row is split among programs. The logprob is
x_t - logsumexp(x) (or the same of x / T with `processed`), summed in the same pass.

Each row is cut into chunks of whole BLOCK columns; one program per (row, chunk) writes partial
results that a second kernel merges per row. No host synchronisation anywhere.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait, libdevice

from tandem.kernels import pdl

BLOCK = 4096  # columns per loop step; fixes the noise layout, so it must not depend on shapes
SUB = BLOCK // 4  # one Philox call yields 4 words: one for each quarter of the block
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _log2(x, FAST_LOG: tl.constexpr):
    """log2; on a GPU the hardware's approximate lg2 (one instruction against the ~30 of tl.log2,
    whose accuracy the noise does not need). The interpreter has no libdevice."""
    if FAST_LOG:
        return libdevice.fast_log2f(x)
    return tl.log2(x)


@triton.jit
def _gumbel(r, FAST_LOG: tl.constexpr):
    """Gumbel noise from 32 random bits, up to a constant: -log(E) with E = -log(1 - w) ~ Exp(1),
    w in (0, 1). E is accurate near 0 (the Gumbel upper tail, where sampling is decided) by a
    series instead of 1 - w rounding to 1. Both logs in base 2: E / ln 2 and a shift of the score
    by log(ln 2), the same for every column, leave the argmax alone."""
    w = tl.minimum((r.to(tl.float32) + 0.5) * 2.3283064365386963e-10, 0.99999994)  # < 1 in fp32
    e2 = tl.where(w < 1e-3, w * (1.0 + 0.5 * w) * LOG2E, -_log2(1.0 - w, FAST_LOG))
    return -LN2 * _log2(e2, FAST_LOG)


@triton.jit
def _scan(x, r, cols, inv_t, greedy, m, s, best, best_idx,
          SAMPLE: tl.constexpr, PROCESSED: tl.constexpr, FAST_LOG: tl.constexpr):
    """Folds one sub-block of fp32 logits x (-inf where masked) into the running state."""
    lp = x * inv_t if PROCESSED else x
    m_new = tl.maximum(m, tl.max(lp, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(lp - m_safe), 0)
    if SAMPLE:
        score = tl.where(greedy, x, x * inv_t + _gumbel(r, FAST_LOG))
    else:
        score = x
    block_best, i = tl.max(score, 0, return_indices=True, return_indices_tie_break_left=True)
    better = block_best > best
    best = tl.where(better, block_best, best)
    best_idx = tl.where(better, tl.min(cols, 0) + i, best_idx)
    return m_new, s, best, best_idx


# The batch size sets the chunking; those arguments are not specialized on, so a serving engine
# whose batch size wanders compiles one variant, not one per size class mid-request.
@triton.jit(do_not_specialize=["blocks_per_chunk", "num_chunks"])
def _sample_chunk_kernel(
    logits_ptr, inv_t_ptr, greedy_ptr, seeds_ptr,
    part_m_ptr, part_s_ptr, part_best_ptr, part_idx_ptr,
    vocab, stride_row, blocks_per_chunk, num_chunks,
    SAMPLE: tl.constexpr,
    PROCESSED: tl.constexpr,
    FAST_LOG: tl.constexpr,
    BLOCK: tl.constexpr,
    SUB: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # launched early (tandem.kernels.pdl): wait for the previous kernel's writes
        gdc_wait()
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    row64 = row.to(tl.int64)
    inv_t = tl.load(inv_t_ptr + row)
    if SAMPLE:
        greedy = tl.load(greedy_ptr + row) != 0
        seed = tl.load(seeds_ptr + row)
    else:
        greedy = True
        seed = 0
    m = -float("inf")
    s = 0.0
    best = -float("inf")
    first_block = chunk * blocks_per_chunk
    best_idx = first_block * BLOCK
    offs = tl.arange(0, SUB)
    base = logits_ptr + row64 * stride_row
    n_blocks = tl.cdiv(vocab, BLOCK)
    for b in range(first_block, tl.minimum(first_block + blocks_per_chunk, n_blocks)):
        if SAMPLE:
            r0, r1, r2, r3 = tl.randint4x(seed, b * SUB + offs)
        else:  # unused
            r0 = offs
            r1 = offs
            r2 = offs
            r3 = offs
        c0 = b * BLOCK + offs
        c1 = c0 + SUB
        c2 = c1 + SUB
        c3 = c2 + SUB
        x0 = tl.load(base + c0, mask=c0 < vocab, other=-float("inf")).to(tl.float32)
        x1 = tl.load(base + c1, mask=c1 < vocab, other=-float("inf")).to(tl.float32)
        x2 = tl.load(base + c2, mask=c2 < vocab, other=-float("inf")).to(tl.float32)
        x3 = tl.load(base + c3, mask=c3 < vocab, other=-float("inf")).to(tl.float32)
        m, s, best, best_idx = _scan(x0, r0, c0, inv_t, greedy, m, s, best, best_idx,
                                     SAMPLE, PROCESSED, FAST_LOG)
        m, s, best, best_idx = _scan(x1, r1, c1, inv_t, greedy, m, s, best, best_idx,
                                     SAMPLE, PROCESSED, FAST_LOG)
        m, s, best, best_idx = _scan(x2, r2, c2, inv_t, greedy, m, s, best, best_idx,
                                     SAMPLE, PROCESSED, FAST_LOG)
        m, s, best, best_idx = _scan(x3, r3, c3, inv_t, greedy, m, s, best, best_idx,
                                     SAMPLE, PROCESSED, FAST_LOG)
    out = row * num_chunks + chunk
    tl.store(part_m_ptr + out, m)
    tl.store(part_s_ptr + out, s)
    tl.store(part_best_ptr + out, best)
    tl.store(part_idx_ptr + out, best_idx)


@triton.jit(do_not_specialize=["num_chunks"])
def _sample_merge_kernel(
    logits_ptr, inv_t_ptr, part_m_ptr, part_s_ptr, part_best_ptr, part_idx_ptr,
    token_ptr, logprob_ptr, token_lp_ptr,
    stride_row, num_chunks,
    PROCESSED: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < num_chunks
    part = row * num_chunks + offs
    m = tl.load(part_m_ptr + part, mask=mask, other=-float("inf"))
    s = tl.load(part_s_ptr + part, mask=mask, other=0.0)
    best = tl.load(part_best_ptr + part, mask=mask, other=-float("inf"))
    idx = tl.load(part_idx_ptr + part, mask=mask, other=0)
    m_max = tl.max(m, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    lse = m_safe + tl.log(tl.sum(s * tl.exp(m - m_safe), 0))
    _, c = tl.max(best, 0, return_indices=True, return_indices_tie_break_left=True)
    token = tl.sum(tl.where(offs == c, idx, 0), 0)
    x_t = tl.load(logits_ptr + row.to(tl.int64) * stride_row + token).to(tl.float32)
    lp_t = x_t * tl.load(inv_t_ptr + row) if PROCESSED else x_t
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(logprob_ptr + row, lp_t - lse)
    tl.store(token_lp_ptr + row, lp_t)


@triton.jit(do_not_specialize=["blocks_per_chunk"])
def _rank_kernel(
    logits_ptr, inv_t_ptr, token_lp_ptr, rank_ptr,
    vocab, stride_row, blocks_per_chunk,
    PROCESSED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """rank[r] += #{i in this chunk: lp_i > lp_token}, lp as the merge kernel computed it."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    inv_t = tl.load(inv_t_ptr + row)
    lp_t = tl.load(token_lp_ptr + row)
    base = logits_ptr + row.to(tl.int64) * stride_row
    offs = tl.arange(0, BLOCK)
    count = tl.zeros([BLOCK], dtype=tl.int32)
    first_block = chunk * blocks_per_chunk
    for b in range(first_block, tl.minimum(first_block + blocks_per_chunk, tl.cdiv(vocab, BLOCK))):
        cols = b * BLOCK + offs
        x = tl.load(base + cols, mask=cols < vocab, other=-float("inf")).to(tl.float32)
        lp = x * inv_t if PROCESSED else x
        count += (lp > lp_t).to(tl.int32)
    tl.atomic_add(rank_ptr + row, tl.sum(count, 0))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    greedy: torch.Tensor | None,
    seeds: torch.Tensor | None,
    processed: bool = False,
    want_ranks: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(token ids [S] int64, their logprobs [S] fp32, their ranks [S] int32 or None).

    logits [S, V] in any float dtype (last dim contiguous); temperature [S] fp32 (1.0 on greedy
    rows); greedy [S] bool and seeds [S] int64 (one Philox key per row), or both None when every
    row is greedy. `processed`: logprobs of logits / T rather than of the raw logits. Ranks count
    the tokens more likely than the sampled one, plus one.
    """
    S, V = logits.shape
    assert logits.stride(1) == 1, "logits need a contiguous last dim"
    assert (greedy is None) == (seeds is None), "greedy and seeds come together"
    dev = logits.device
    token = torch.empty(S, dtype=torch.int64, device=dev)
    logprob = torch.empty(S, dtype=torch.float32, device=dev)
    ranks = torch.ones(S, dtype=torch.int32, device=dev) if want_ranks else None
    if S == 0:
        return token, logprob, ranks
    n_blocks = triton.cdiv(V, BLOCK)
    # The Philox and log work makes this ALU-bound more than memory-bound: ~16 programs per SM
    # keep the last wave's tail short.
    num_chunks = max(1, min(n_blocks, triton.cdiv(16 * _num_sms(dev), S)))
    blocks_per_chunk = triton.cdiv(n_blocks, num_chunks)
    num_chunks = triton.cdiv(n_blocks, blocks_per_chunk)
    inv_t = 1.0 / temperature.float()
    # Each partial array starts 16-byte aligned whatever S is: Triton specializes pointers on
    # alignment, and a batch size that moved part[1] off it would compile another variant.
    n_part = -(-S * num_chunks // 4) * 4
    part = torch.empty(3, n_part, dtype=torch.float32, device=dev)[:, : S * num_chunks].view(3, S, num_chunks)
    part_idx = torch.empty(S, num_chunks, dtype=torch.int32, device=dev)
    sample_rows = greedy is not None
    launch_pdl = pdl.enabled(logits)
    _sample_chunk_kernel[(S, num_chunks)](
        logits, inv_t, greedy if sample_rows else inv_t, seeds if sample_rows else inv_t,
        part[0], part[1], part[2], part_idx,
        V, logits.stride(0), blocks_per_chunk, num_chunks,
        SAMPLE=sample_rows, PROCESSED=processed, FAST_LOG=dev.type == "cuda", BLOCK=BLOCK, SUB=SUB,
        PDL=launch_pdl, num_warps=4, launch_pdl=launch_pdl,
    )
    token_lp = torch.empty(S, dtype=torch.float32, device=dev)
    _sample_merge_kernel[(S,)](
        logits, inv_t, part[0], part[1], part[2], part_idx,
        token, logprob, token_lp,
        logits.stride(0), num_chunks,
        PROCESSED=processed, BLOCK_C=triton.next_power_of_2(n_blocks), PDL=launch_pdl, num_warps=1,
        launch_pdl=launch_pdl,
    )
    if want_ranks:
        _rank_kernel[(S, num_chunks)](
            logits, inv_t, token_lp, ranks,
            V, logits.stride(0), blocks_per_chunk * (BLOCK // 1024),
            PROCESSED=processed, BLOCK=1024, num_warps=4,
        )
    return token, logprob, ranks
