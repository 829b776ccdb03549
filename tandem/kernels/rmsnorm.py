"""Triton RMSNorm, alone and fused with the residual add, beside their torch references.

Semantics are those of `rmsnorm_ref` (HF's RMSNorm): the residual add is rounded to the
activation dtype, the norm is computed in fp32 and cast back to that dtype, and only then
multiplied by the weight (the product in the promoted dtype of weight and activation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.rmsnorm_ref import fused_add_rms_norm_ref, rms_norm_ref  # noqa: F401 (the references)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # rounded like torch
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    var = tl.sum(x32 * x32, 0) / N
    y = (x32 * (1.0 / tl.sqrt(var + eps))).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    out = y.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, weight, eps):
    hidden = x.shape[-1]
    assert weight.shape == (hidden,), f"weight shape {tuple(weight.shape)} != ({hidden},)"
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        r2 = residual.reshape(-1, hidden)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        res_out = torch.empty_like(x2)
    else:
        r2 = res_out = x2  # unused
    block = triton.next_power_of_2(hidden)
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight.contiguous(), out, res_out,
            x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
            eps,
            N=hidden,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, block // 256)),
        )
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., D] with weight [D]."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum rounded to x's dtype; inputs unchanged."""
    return _launch(x, residual, weight, eps)[:2]
