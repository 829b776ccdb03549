"""Triton sampling for the common case: temperature, a draw from softmax(x / T), and the sampled
token's logprob, in one read of the logits and one small pass, with no [S, V] intermediate.

The vocabulary is cut into chunks of BLOCK columns, fixed by BLOCK alone (never by the batch
size). A draw is two-level and exact in distribution:

1. `_chunk_kernel`, one program per (row, chunk): the chunk's max and sum of exp2 of
   x / T (in log2 units), and for greedy rows its argmax. One exp a column: no noise here.
2. `_sample_merge_kernel`, one program per row: the row's log-sum-exp from the chunks; a chunk
   drawn with probability its share of the row's mass (one uniform u: the first chunk whose
   running mass passes u times the total); then a token inside it by Gumbel-max,
   argmax_i(x_i / T + G_i), which draws from softmax restricted to the chunk. P(token) =
   P(chunk) * P(token | chunk) = softmax(x / T)[token].

The first design ran Gumbel-max over every column (Philox and two logs per column) and was
ALU-bound at 0.12 ms for 256 rows of a 151,936-token vocabulary on an H200; here the noise is
drawn for one chunk a row. Chunk masses are summed in fp32 in a fixed order, so an inverse-CDF
step over the ~40 chunks (not over every token, where tiny probabilities would vanish into a
running sum) misplaces at most a few ulps of the row's mass.

The noise of row r comes from Philox keyed by `seeds[r]` (the chunk's uniform at a counter no
column uses, each column's Gumbel at the column's counter), so a row's token depends on its
logits and seed alone: not on the batch size or the row's position. Greedy rows take
argmax_i x_i (first index on ties, like torch.argmax). The logprob is x_t - logsumexp(x) (or
the same of x / T with `processed`). No host synchronisation anywhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait, libdevice

from tandem.kernels import pdl

BLOCK = 4096  # columns a chunk; fixes the chunks and the noise layout, so no shape may change it
SUB = BLOCK // 4  # one Philox call yields 4 words: one for each quarter of a chunk
CHUNK_COUNTER = tl.constexpr(0x7FFFFFFF)  # the Philox counter of a row's chunk uniform: past every column's
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
def _unit(r):
    """32 random bits -> a uniform in (0, 1), never 0 or 1 in fp32."""
    return tl.minimum((r.to(tl.float32) + 0.5) * 2.3283064365386963e-10, 0.99999994)


@triton.jit
def _gumbel(r, FAST_LOG: tl.constexpr):
    """Gumbel noise from 32 random bits, up to a constant: -log(E) with E = -log(1 - w) ~ Exp(1),
    w in (0, 1). E is accurate near 0 (the Gumbel upper tail, where sampling is decided) by a
    series instead of 1 - w rounding to 1. Both logs in base 2: E / ln 2 and a shift of the score
    by log(ln 2), the same for every column, leave the argmax alone."""
    w = _unit(r)
    e2 = tl.where(w < 1e-3, w * (1.0 + 0.5 * w) * LOG2E, -_log2(1.0 - w, FAST_LOG))
    return -LN2 * _log2(e2, FAST_LOG)


@triton.jit
def _raw_sums(inv_t, PROCESSED: tl.constexpr):
    """Whether the logprob needs sums of its own: of the raw logits, where T != 1 (else the
    draw's sums of x / T are the logprob's too). Both kernels ask this one question."""
    if PROCESSED:
        return False
    return inv_t != 1.0


@triton.jit
def _fold(y, m, s):
    """Folds y (log2 units, -inf where masked) into a running (max, sum of exp2(y - max))."""
    m_new = tl.maximum(m, tl.max(y, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, s * tl.exp2(m - m_safe) + tl.sum(tl.exp2(y - m_safe), 0)


@triton.jit
def _fold_best(x, cols, best, best_idx):
    """Folds x into a running (max, first index of it)."""
    block_best, i = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    better = block_best > best
    return tl.where(better, block_best, best), tl.where(better, tl.min(cols, 0) + i, best_idx)


@triton.jit
def _load_sub(base, c, vocab):
    return tl.load(base + c, mask=c < vocab, other=-float("inf")).to(tl.float32)


# The batch size sets only the grid: one compiled variant for every batch.
@triton.jit
def _chunk_kernel(
    logits_ptr, inv_t_ptr, greedy_ptr,
    part_m_ptr, part_s_ptr, part_rm_ptr, part_rs_ptr, part_best_ptr, part_idx_ptr,
    vocab, stride_row, num_chunks,
    SAMPLE: tl.constexpr,
    PROCESSED: tl.constexpr,
    BLOCK: tl.constexpr,
    SUB: tl.constexpr,
    PDL: tl.constexpr,
):
    """Per (row, chunk): (max, sum) of exp2 over y = x / T in log2 units (the sampling
    distribution; a greedy row has T = 1), the same of the raw x where the logprob's sums differ
    from those (`_raw_sums`), and a greedy row's argmax."""
    if PDL:  # launched early (tandem.kernels.pdl): wait for the previous kernel's writes
        gdc_wait()
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    inv_t = tl.load(inv_t_ptr + row)
    scale = inv_t * LOG2E
    greedy = True
    if SAMPLE:
        greedy = tl.load(greedy_ptr + row) != 0
    raw_too = _raw_sums(inv_t, PROCESSED)
    base = logits_ptr + row.to(tl.int64) * stride_row
    offs = chunk * BLOCK + tl.arange(0, SUB)
    m = -float("inf")
    s = 0.0
    rm = -float("inf")
    rs = 0.0
    best = -float("inf")
    best_idx = chunk * BLOCK
    for q in tl.static_range(4):
        x = _load_sub(base, offs + q * SUB, vocab)
        m, s = _fold(x * scale, m, s)
        if raw_too:
            rm, rs = _fold(x * LOG2E, rm, rs)
        if greedy:
            best, best_idx = _fold_best(x, offs + q * SUB, best, best_idx)
    out = row * num_chunks + chunk
    tl.store(part_m_ptr + out, m)
    tl.store(part_s_ptr + out, s)
    if raw_too:
        tl.store(part_rm_ptr + out, rm)
        tl.store(part_rs_ptr + out, rs)
    tl.store(part_best_ptr + out, best)
    tl.store(part_idx_ptr + out, best_idx)


@triton.jit
def _noisy_best(base, cols, vocab, inv_t, r, best, best_idx, FAST_LOG: tl.constexpr):
    """Folds the columns' x / T + Gumbel noise (from the random words r) into a running argmax."""
    return _fold_best(_load_sub(base, cols, vocab) * inv_t + _gumbel(r, FAST_LOG), cols, best, best_idx)


@triton.jit
def _lse2(m, s):
    """log2 of sum_c s_c * 2^m_c over the chunks; -inf when every column is masked."""
    top = tl.max(m, 0)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    return top_safe + tl.log2(tl.sum(s * tl.exp2(m - top_safe), 0))


@triton.jit
def _sample_merge_kernel(
    logits_ptr, inv_t_ptr, greedy_ptr, seeds_ptr,
    part_m_ptr, part_s_ptr, part_rm_ptr, part_rs_ptr, part_best_ptr, part_idx_ptr,
    token_ptr, logprob_ptr, token_lp_ptr,
    vocab, stride_row, num_chunks,
    SAMPLE: tl.constexpr,
    PROCESSED: tl.constexpr,
    FAST_LOG: tl.constexpr,
    BLOCK: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()
    row = tl.program_id(0)
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < num_chunks
    part = row * num_chunks + offs_c
    m = tl.load(part_m_ptr + part, mask=mask_c, other=-float("inf"))
    s = tl.load(part_s_ptr + part, mask=mask_c, other=0.0)
    inv_t = tl.load(inv_t_ptr + row)
    greedy = True
    seed = 0
    if SAMPLE:
        greedy = tl.load(greedy_ptr + row) != 0
        seed = tl.load(seeds_ptr + row)
    base = logits_ptr + row.to(tl.int64) * stride_row
    if greedy:
        chunk_best = tl.load(part_best_ptr + part, mask=mask_c, other=-float("inf"))
        chunk_idx = tl.load(part_idx_ptr + part, mask=mask_c, other=0)
        _, c = tl.max(chunk_best, 0, return_indices=True, return_indices_tie_break_left=True)
        token = tl.sum(tl.where(offs_c == c, chunk_idx, 0), 0)
    else:
        # the chunk: the first whose running mass passes u * total (masses in a fixed order)
        top = tl.max(m, 0)
        mass = s * tl.exp2(m - tl.where(top == float("-inf"), 0.0, top))
        running = tl.cumsum(mass, 0)
        u = tl.sum(_unit(tl.randint(seed, tl.full([1], CHUNK_COUNTER, tl.int32))), 0)
        passed = tl.sum((running <= u * tl.max(running, 0)).to(tl.int32), 0)
        last = tl.max(tl.where(mass > 0.0, offs_c, 0), 0)  # past the end by rounding: the last
        chunk = tl.minimum(passed, last)
        # the token inside it: Gumbel-max over the chunk, the noise keyed by column
        cols = chunk * BLOCK + tl.arange(0, SUB)
        r0, r1, r2, r3 = tl.randint4x(seed, chunk * SUB + tl.arange(0, SUB))
        best = -float("inf")
        token = chunk * BLOCK
        best, token = _noisy_best(base, cols, vocab, inv_t, r0, best, token, FAST_LOG)
        best, token = _noisy_best(base, cols + SUB, vocab, inv_t, r1, best, token, FAST_LOG)
        best, token = _noisy_best(base, cols + 2 * SUB, vocab, inv_t, r2, best, token, FAST_LOG)
        best, token = _noisy_best(base, cols + 3 * SUB, vocab, inv_t, r3, best, token, FAST_LOG)
    if _raw_sums(inv_t, PROCESSED):
        rm = tl.load(part_rm_ptr + part, mask=mask_c, other=-float("inf"))
        rs = tl.load(part_rs_ptr + part, mask=mask_c, other=0.0)
        lse2 = _lse2(rm, rs)
    else:
        lse2 = _lse2(m, s)
    x_t = tl.load(base + token).to(tl.float32)
    lp_t = x_t * inv_t if PROCESSED else x_t
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(logprob_ptr + row, lp_t - lse2 * LN2)
    tl.store(token_lp_ptr + row, lp_t)


@triton.jit
def _rank_kernel(
    logits_ptr, inv_t_ptr, token_lp_ptr, rank_ptr,
    vocab, stride_row,
    PROCESSED: tl.constexpr,
    BLOCK: tl.constexpr,
    SUB: tl.constexpr,
):
    """rank[r] += #{i in this chunk: lp_i > lp_token}, lp as the merge kernel computed it."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    inv_t = tl.load(inv_t_ptr + row)
    lp_t = tl.load(token_lp_ptr + row)
    base = logits_ptr + row.to(tl.int64) * stride_row
    offs = chunk * BLOCK + tl.arange(0, SUB)
    count = tl.zeros([SUB], dtype=tl.int32)
    for q in tl.static_range(BLOCK // SUB):
        x = _load_sub(base, offs + q * SUB, vocab)
        lp = x * inv_t if PROCESSED else x
        count += (lp > lp_t).to(tl.int32)
    tl.atomic_add(rank_ptr + row, tl.sum(count, 0))


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
    num_chunks = triton.cdiv(V, BLOCK)
    inv_t = 1.0 / temperature.float()
    # Each partial array starts 16-byte aligned whatever S is: Triton specializes pointers on
    # alignment, and a batch size that moved part[1] off it would compile another variant.
    n_part = -(-S * num_chunks // 4) * 4
    part = torch.empty(5, n_part, dtype=torch.float32, device=dev)[:, : S * num_chunks]
    part_idx = torch.empty(S * num_chunks, dtype=torch.int32, device=dev)
    sample_rows = greedy is not None
    launch_pdl = pdl.enabled(logits)
    greedy_arg = greedy if sample_rows else inv_t
    _chunk_kernel[(S, num_chunks)](
        logits, inv_t, greedy_arg, *part, part_idx,
        V, logits.stride(0), num_chunks,
        SAMPLE=sample_rows, PROCESSED=processed, BLOCK=BLOCK, SUB=SUB,
        PDL=launch_pdl, num_warps=4, launch_pdl=launch_pdl,
    )
    token_lp = torch.empty(S, dtype=torch.float32, device=dev)
    _sample_merge_kernel[(S,)](
        logits, inv_t, greedy_arg, seeds if sample_rows else inv_t, *part, part_idx,
        token, logprob, token_lp,
        V, logits.stride(0), num_chunks,
        SAMPLE=sample_rows, PROCESSED=processed, FAST_LOG=dev.type == "cuda", BLOCK=BLOCK, SUB=SUB,
        BLOCK_C=triton.next_power_of_2(num_chunks), PDL=launch_pdl, num_warps=4,
        launch_pdl=launch_pdl,
    )
    if want_ranks:
        _rank_kernel[(S, num_chunks)](
            logits, inv_t, token_lp, ranks,
            V, logits.stride(0),
            PROCESSED=processed, BLOCK=BLOCK, SUB=1024, num_warps=4,
        )
    return token, logprob, ranks
