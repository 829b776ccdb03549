"""Batch-invariant Triton kernels, beside their torch references (`batch_invariant_ref`).

A GEMM library picks its kernel by shape: split-K for a few rows, other tiles for many, so a
row's sum runs in an order that depends on how many rows share the launch, and in bf16 the last
bits differ. Here one tile configuration serves every M and each output element is the same
fp32 sum over K in the same order, whatever else is in the batch (`linear`). The log-prob of a
chosen token is one program per row streaming the vocabulary in fixed blocks
(`token_logprobs`), where torch's reductions may split a row across programs when rows are few.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.batch_invariant_ref import linear_ref, token_logprobs_ref  # noqa: F401 (references)

# One tile configuration for every shape (changing it changes the numbers, not their invariance).
BLOCK_M, BLOCK_N, BLOCK_K = 64, 128, 64
VOCAB_BLOCK = 1024


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + rk) < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + (k0 + rk)[:, None],
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [K, N]: W^T's tile
        if USE_DOT:
            acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        else:  # the interpreter's tl.dot is a BLAS call whose rows round by their place in the tile
            acc += tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) -> [..., N] in `out_dtype` (x's by default),
    each element an fp32 sum over K in blocks of BLOCK_K, in order, rounded once."""
    K = x.shape[-1]
    N = weight.shape[0]
    assert weight.shape == (N, K), f"weight {tuple(weight.shape)} does not take inputs of width {K}"
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    M = x2.shape[0]
    out = torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    if M and N:
        grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
        _linear_kernel[grid](
            x2, weight, bias if bias is not None else weight, out,
            M, N, K,
            x2.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            USE_DOT=x.is_cuda,  # tensor cores: every element of a tile sums alike
            num_warps=4, num_stages=3,
        )
    return out.view(*x.shape[:-1], N)


@triton.jit
def _token_logprobs_kernel(
    logits_ptr, stride_l, tokens_ptr, inv_t_ptr, out_ptr, V,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_l
    inv_t = tl.load(inv_t_ptr + row)
    offs = tl.arange(0, BLOCK)
    # Per-lane running max and sum, combined once at the end: a fixed order for every row.
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, V, BLOCK):
        x = tl.load(base + start + offs, mask=start + offs < V, other=float("-inf")).to(tl.float32) * inv_t
        new_m = tl.maximum(m, x)
        safe = tl.where(new_m == float("-inf"), 0.0, new_m)
        s = s * tl.exp(m - safe) + tl.exp(x - safe)
        m = new_m
    row_max = tl.max(m, 0)
    total = tl.sum(s * tl.exp(m - row_max), 0)
    tok = tl.load(tokens_ptr + row)
    picked = tl.load(base + tok).to(tl.float32) * inv_t
    tl.store(out_ptr + row, picked - row_max - tl.log(total))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: torch.Tensor | None = None) -> torch.Tensor:
    """log_softmax(logits [R, V] * (1 / T))[tokens] -> [R] fp32; temperature [R] (None: 1)."""
    R, V = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if temperature is None:
        inv_t = torch.ones(R, dtype=torch.float32, device=logits.device)
    else:
        inv_t = 1.0 / temperature.float()
    out = torch.empty(R, dtype=torch.float32, device=logits.device)
    if R:
        _token_logprobs_kernel[(R,)](logits, logits.stride(0), tokens.contiguous(), inv_t.contiguous(), out, V,
                                     BLOCK=VOCAB_BLOCK, num_warps=4)
    return out
