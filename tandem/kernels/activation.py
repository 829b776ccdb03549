"""Triton SiLU-and-multiply, forward (merged or separate gate/up) and backward, beside its torch
reference.

Rounded as torch computes `F.silu(gate) * up`: silu in fp32 rounded to the activation dtype,
then the product in fp32 rounded again. The backward (the trainer's SwiGLU,
`tandem.rl.fused_layers`) recomputes silu from the gate and rounds as autograd does: the
product's gradients to the activation dtype, then silu's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tandem.kernels import pdl
from tandem.kernels.activation_ref import silu_and_mul_ref, silu_mul_ref  # noqa: F401 (the references)

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    gate_ptr, up_ptr, out_ptr, stride_g, stride_u, stride_o,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
    TRIGGER: tl.constexpr = False,
):
    if PDL:  # launched early (tandem.kernels.pdl): wait for the previous kernel's writes
        gdc_wait()
    if TRIGGER:  # the next kernel may start now (pdl.EARLY)
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(gate_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(gate_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_bwd_kernel(
    dy_ptr, gate_ptr, up_ptr, dg_ptr, du_ptr,
    stride_dy, stride_g, stride_u, stride_dg, stride_du,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    dtype = gate_ptr.dtype.element_ty
    dy = tl.load(dy_ptr + row * stride_dy + offs, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # as the forward rounded it
    d_silu = (dy * up).to(dtype).to(tl.float32)
    tl.store(du_ptr + row * stride_du + offs, (dy * silu).to(du_ptr.dtype.element_ty), mask=mask)
    d_gate = d_silu * (sig * (1.0 + gate * (1.0 - sig)))  # torch's silu_backward
    tl.store(dg_ptr + row * stride_dg + offs, d_gate.to(dg_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    t2 = t.reshape(-1, width)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _grid(rows: int, inter: int) -> tuple[int, int]:
    return rows, triton.cdiv(inter, min(_BLOCK, triton.next_power_of_2(inter)))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2*I] -> silu(x[..., :I]) * x[..., I:], shape [..., I]."""
    inter = x.shape[-1] // 2
    assert x.shape[-1] == 2 * inter, f"last dim ({x.shape[-1]}) must be even"
    x2 = _rows(x, 2 * inter)
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0 and inter > 0:
        launch_pdl = pdl.enabled(x2)
        _silu_and_mul_kernel[_grid(x2.shape[0], inter)](
            x2, x2[:, inter:], out, x2.stride(0), x2.stride(0), out.stride(0),
            INTER=inter, BLOCK=min(_BLOCK, triton.next_power_of_2(inter)), PDL=launch_pdl,
            TRIGGER=launch_pdl and pdl.EARLY,
            num_warps=4, launch_pdl=launch_pdl,
        )
    return out.view(*x.shape[:-1], inter)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate, up [..., I] of one dtype (the HF MLP's two projections)."""
    assert gate.shape == up.shape and gate.dtype == up.dtype, f"{gate.shape=} {up.shape=}"
    inter = gate.shape[-1]
    g2, u2 = _rows(gate, inter), _rows(up, inter)
    out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    if g2.shape[0] > 0 and inter > 0:
        launch_pdl = pdl.enabled(g2)
        _silu_and_mul_kernel[_grid(g2.shape[0], inter)](
            g2, u2, out, g2.stride(0), u2.stride(0), out.stride(0),
            INTER=inter, BLOCK=min(_BLOCK, triton.next_power_of_2(inter)), PDL=launch_pdl,
            TRIGGER=launch_pdl and pdl.EARLY,
            num_warps=4, launch_pdl=launch_pdl,
        )
    return out.view(gate.shape)


def silu_mul_backward(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) of `silu_mul(gate, up)` given dy; silu recomputed from gate."""
    inter = gate.shape[-1]
    g2, u2, dy2 = _rows(gate, inter), _rows(up, inter), _rows(dy, inter)
    dg = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    du = torch.empty(u2.shape, dtype=up.dtype, device=up.device)
    if g2.shape[0] > 0 and inter > 0:
        _silu_and_mul_bwd_kernel[_grid(g2.shape[0], inter)](
            dy2, g2, u2, dg, du,
            dy2.stride(0), g2.stride(0), u2.stride(0), dg.stride(0), du.stride(0),
            INTER=inter, BLOCK=min(_BLOCK, triton.next_power_of_2(inter)), num_warps=4,
        )
    return dg.view(gate.shape), du.view(up.shape)
