"""Triton kernels for the elementwise work of the trainer's fused log-prob head
(`tandem.rl.logprobs`), one pass over a chunk's fp32 logits each way, beside their torch references.

- forward: each row's logsumexp (online max and sum of exp, block by block) and the target's
  log-prob x_t - lse, in one read of x;
- backward: the gradient wrt the GEMM's logits, (1[j=t] - exp(x - lse)) * grad / T, in one read of
  x and one write in the GEMM's dtype, over x's own storage.

Logits filtered to -inf (top-k / top-p / min-p) are fine both ways: they add exp(-inf) = 0 to the
sum and get a zero gradient. One program per row, which loops over the vocabulary.

Shape suffixes: C = tokens of a chunk, V = vocabulary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.head_logprobs_ref import (  # noqa: F401 (the references)
    logprob_grad_ref,
    lse_logprobs_ref,
)

BLOCK = 4096  # columns per loop step (16 fp32 a thread at 8 warps)


@triton.jit
def _lse_logprobs_kernel(x_ptr, target_ptr, lse_ptr, logp_ptr, stride_x, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK)
    m = -float("inf")
    s = 0.0
    for start in range(0, V, BLOCK):
        cols = start + offs
        x = tl.load(base + cols, mask=cols < V, other=-float("inf"))
        m_new = tl.maximum(m, tl.max(x, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block of filtered tokens only
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), 0)
        m = m_new
    lse = m + tl.log(s)
    x_t = tl.load(base + tl.load(target_ptr + row))
    tl.store(lse_ptr + row, lse)
    tl.store(logp_ptr + row, x_t - lse)


@triton.jit
def _logprob_grad_kernel(x_ptr, g_ptr, lse_ptr, scale_ptr, target_ptr, stride_x, stride_g, V,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_base = x_ptr + row * stride_x
    g_base = g_ptr + row * stride_g
    lse = tl.load(lse_ptr + row)
    scale = tl.load(scale_ptr + row)
    target = tl.load(target_ptr + row)
    offs = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        cols = start + offs
        mask = cols < V
        x = tl.load(x_base + cols, mask=mask, other=0.0)
        g = (tl.where(cols == target, 1.0, 0.0) - tl.exp(x - lse)) * scale
        # A g narrower than x lands on fp32 columns of this block or earlier ones that other
        # threads of the program read: all of them must have read before any thread writes.
        # Later blocks are never written over, so the blocks must run in order, in one program.
        tl.debug_barrier()
        tl.store(g_base + cols, g.to(g_ptr.dtype.element_ty), mask=mask)


def _launch(V: int) -> dict:
    return {"BLOCK": min(BLOCK, triton.next_power_of_2(V)), "num_warps": 8 if V >= BLOCK else 4}


def lse_logprobs(x_CV: torch.Tensor, target_C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logsumexp [C], x[c, target[c]] - logsumexp [C]), fp32, of fp32 logits x [C, V] (last dim
    contiguous; -inf entries allowed, not at the target)."""
    C, V = x_CV.shape
    assert x_CV.dtype == torch.float32 and x_CV.stride(1) == 1, "fp32 logits, contiguous rows"
    lse_C = torch.empty(C, dtype=torch.float32, device=x_CV.device)
    logp_C = torch.empty_like(lse_C)
    if C:
        _lse_logprobs_kernel[(C,)](x_CV, target_C.contiguous(), lse_C, logp_C, x_CV.stride(0), V,
                                   **_launch(V))
    return lse_C, logp_C


def logprob_grad_(x_CV: torch.Tensor, lse_C: torch.Tensor, grad_C: torch.Tensor,
                  target_C: torch.Tensor, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """`logprob_grad_ref` written over x's storage, which it consumes: a [C, V] view of it in
    `dtype` whose rows keep x's bytes per row (the GEMMs take such padded rows as they are).

    In place rather than into a new tensor: a chunk's fp32 logits are ~1 GiB, and a bf16 copy
    beside them would add half of that to the backward's peak."""
    C, V = x_CV.shape
    assert x_CV.dtype == torch.float32 and x_CV.stride(1) == 1, "fp32 logits, contiguous rows"
    assert dtype.itemsize <= 4, f"the gradient must fit in x's storage, got {dtype}"
    g_CV = x_CV.view(dtype)[:, :V]
    scale_C = grad_C.float() / temperature
    if C:
        _logprob_grad_kernel[(C,)](x_CV, g_CV, lse_C.contiguous(), scale_C, target_C.contiguous(),
                                   x_CV.stride(0), g_CV.stride(0), V, **_launch(V))
    return g_CV
