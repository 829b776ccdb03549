"""Triton RMSNorm, alone and fused with the residual add, and its backward, beside their torch
references.

Semantics are those of `rmsnorm_ref` (HF's RMSNorm): the residual add is rounded to the
activation dtype, the norm is computed in fp32 and cast back to that dtype, and only then
multiplied by the weight (the product in the promoted dtype of weight and activation). The
backward (the trainer's, `tandem.rl.fused_layers`) rounds its gradients where HF's autograd does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tandem.kernels import pdl
from tandem.kernels.rmsnorm_ref import (  # noqa: F401 (the references)
    fused_add_rms_norm_ref,
    rms_norm_backward_ref,
    rms_norm_ref,
)

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
    TRIGGER: tl.constexpr = False,
):
    if PDL:  # launched early (tandem.kernels.pdl): wait for the previous kernel's writes
        gdc_wait()
    if TRIGGER:  # the next kernel may start now (pdl.EARLY)
        gdc_launch_dependents()
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


def _launch(x, residual, weight, eps, out_dtype=None):
    hidden = x.shape[-1]
    assert weight.shape == (hidden,), f"weight shape {tuple(weight.shape)} != ({hidden},)"
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out_dtype = out_dtype or torch.promote_types(weight.dtype, x.dtype)
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
        launch_pdl = pdl.enabled(x2)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight.contiguous(), out, res_out,
            x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
            eps,
            N=hidden,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            PDL=launch_pdl, TRIGGER=launch_pdl and pdl.EARLY,
            num_warps=min(16, max(1, block // 256)),
            launch_pdl=launch_pdl,
        )
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., D] with weight [D]. `out_dtype` (default: weight's and
    x's promoted dtype, HF's) rounds the same fp32 product to another dtype, as a cast after it
    would: the trainer's norms hand autocast's linears bf16 directly."""
    return _launch(x, None, weight, eps, out_dtype)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum rounded to x's dtype; inputs unchanged."""
    return _launch(x, residual, weight, eps)[:2]


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, dx_ptr, dw_ptr,
    stride_dy, stride_x, stride_dx,
    M, rows_per_program, eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_DW: tl.constexpr,
    PROD_T: tl.constexpr,
):
    """Rows [pid * rows_per_program, +rows_per_program): dx of each, and this program's partial sum
    of dw (fp32) in row pid of dw_ptr [programs, N]. rstd is recomputed from x (no saved state).
    PROD_T is HF's output dtype (weight x activation promoted): its grads are rounded to it, and
    the norm's to x's dtype, as autograd rounds them through HF's casts."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x_t = x_ptr.dtype.element_ty
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    start = pid.to(tl.int64) * rows_per_program  # int64 rows: row * stride may pass 2**31
    end = tl.minimum(start + rows_per_program, M)
    for row in range(start, end):
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * stride_dy + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
        n = x * rstd
        dn = (dy * w).to(PROD_T).to(x_t).to(tl.float32)
        if HAS_DW:
            dw += (dy * n.to(x_t).to(tl.float32)).to(PROD_T).to(tl.float32)
        dx = rstd * (dn - n * (tl.sum(dn * n, 0) / N))
        tl.store(dx_ptr + row * stride_dx + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    if HAS_DW:
        tl.store(dw_ptr + pid * N + offs, dw, mask=mask)


def _num_programs(rows: int, device: torch.device) -> int:
    """Enough programs to fill the GPU (a few per SM), each reducing its rows' dw in registers."""
    if device.type != "cuda":
        return max(1, min(rows, 4))
    return max(1, min(rows, 4 * torch.cuda.get_device_properties(device).multi_processor_count))


def rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, weight_grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients (dx, dweight) of `rms_norm(x, weight, eps)` given dy (any float dtype: the output
    may have been emitted in another). dweight (None without `weight_grad`) is summed over rows
    in fp32, per program then across programs, and returned in weight's dtype."""
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    dy2 = dy.reshape(-1, hidden)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    dy2 = dy2 if dy2.stride(-1) == 1 else dy2.contiguous()
    rows = x2.shape[0]
    dx = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    programs = _num_programs(rows, x.device)
    per_program = triton.cdiv(rows, programs) if rows else 0
    dw_partial = torch.empty((programs, hidden) if weight_grad else (1, 1), dtype=torch.float32,
                             device=x.device)
    block = triton.next_power_of_2(hidden)
    if rows > 0:
        _rms_norm_bwd_kernel[(programs,)](
            dy2, x2, weight.contiguous(), dx, dw_partial,
            dy2.stride(0), x2.stride(0), dx.stride(0),
            rows, per_program, eps,
            N=hidden,
            BLOCK=block,
            HAS_DW=weight_grad,
            PROD_T=TL_DTYPES[torch.promote_types(weight.dtype, x.dtype)],
            num_warps=min(16, max(1, block // 256)),
        )
    dw = None
    if weight_grad:
        dw = (dw_partial.sum(0) if rows else torch.zeros(hidden, device=x.device)).to(weight.dtype)
    return dx.view(x.shape), dw
