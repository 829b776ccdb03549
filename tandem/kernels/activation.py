"""Triton SiLU-and-multiply over a merged gate/up projection, beside its torch reference.

Rounded as torch computes `F.silu(gate) * up`: silu in fp32 rounded to the activation dtype,
then the product in fp32 rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.activation_ref import silu_and_mul_ref  # noqa: F401 (the reference)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2*I] -> silu(x[..., :I]) * x[..., I:], shape [..., I]."""
    inter = x.shape[-1] // 2
    assert x.shape[-1] == 2 * inter, f"last dim ({x.shape[-1]}) must be even"
    x2 = x.reshape(-1, 2 * inter)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(inter))
    if x2.shape[0] > 0 and inter > 0:
        grid = (x2.shape[0], triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](
            x2, out, x2.stride(0), out.stride(0), INTER=inter, BLOCK=block, num_warps=4
        )
    return out.view(*x.shape[:-1], inter)
