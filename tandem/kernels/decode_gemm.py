"""Triton GEMM for decode's few rows, `x @ W.T (+ bias)`, with a deterministic split-K.

Reference: `decode_gemm_ref.linear_ref`. A decode step multiplies M <= 256 rows by every weight
once, so a launch is a few dozen output tiles: too few for 132 SMs when N is small (q/k/v, o, the
down projection) unless K is split too. Here the K splits of a tile are programs of one launch;
each writes its fp32 partial sum to a workspace, and the last to finish (a per-tile counter says
which) adds the partials up in split order, adds the bias, rounds once and resets the counter.
No second kernel, and no atomics on the data: the sum's order is fixed, so a config gives the
same bits on every run (cuBLAS's split-K runs a separate reduction kernel after the GEMM).

Programs that share a weight tile are launched next to each other (the M tiles of one N tile),
so the weight is read from HBM once and from L2 after. The counters (`tandem.kernels.counters`)
are zero outside a launch (each kernel resets what it used), so a CUDA graph replays it as is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from tandem.kernels import pdl
from tandem.kernels.counters import MAX_COUNTERS, counters
from tandem.kernels.decode_gemm_ref import linear_ref  # noqa: F401 (the reference)


@dataclass(frozen=True)
class GemmConfig:
    """One launch configuration; `default_config` picks one from shapes."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _silu_mul(gate, up):
    """silu(gate) * up rounded as `activation.silu_and_mul` rounds it: silu in fp32 rounded to the
    activation dtype, then the product in fp32 rounded again."""
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return (silu * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _epilogue(acc, bias_ptr, out_ptr, rm, rn, N, mask, stride_om, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:  # added to the fp32 sum, then one rounding (cuBLAS's bias epilogue does too)
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


# One compiled variant for every M and split count (both runtime arguments).
@triton.jit(do_not_specialize=["M", "num_splits"])
def _gemm_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, ws_ptr, count_ptr,
    M, N, K, k_per_split, num_splits,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr,
    GLU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PARTIAL: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # launched early (tandem.kernels.pdl): wait for the previous kernel's writes
        gdc_wait()
    tile = tl.program_id(0)
    split = tl.program_id(1)
    grid_m = tl.cdiv(M, BLOCK_M)
    pid_m = tile % grid_m  # the M tiles of one weight tile run side by side: one HBM read
    pid_n = tile // grid_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows and columns past the end are read wrapped around (never stored): unmasked loads.
    rm_in = (rm % M).to(tl.int64)
    rn_in = (rn % N).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    x_ptrs = x_ptr + rm_in[:, None] * stride_xm + (k_lo + rk)[None, :]
    w_ptrs = w_ptr + rn_in[:, None] * stride_wn + (k_lo + rk)[None, :]  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            if GLU:  # x is [gate | up], K wide each: the input is silu(gate) * up
                x = _silu_mul(x, tl.load(x_ptrs + K))
            w = tl.load(w_ptrs)
        else:
            k_mask = (k + rk) < k_hi
            x = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
            if GLU:  # (masked: silu(0) * 0 = 0)
                x = _silu_mul(x, tl.load(x_ptrs + K, mask=k_mask[None, :], other=0.0))
            w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if PARTIAL:
        ws_offs = rm.to(tl.int64)[:, None] * N + rn[None, :]
        tl.store(ws_ptr + split * M * N + ws_offs, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the counter moves
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:  # the last split of this tile sums all, in split order
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(num_splits):
                acc += tl.load(ws_ptr + s * M * N + ws_offs, mask=mask, other=0.0,
                               cache_modifier=".cg")  # from L2, where the other SMs wrote it
            _epilogue(acc, bias_ptr, out_ptr, rm, rn, N, mask, stride_om, HAS_BIAS)
            tl.atomic_xchg(count_ptr + tile, 0)  # zero again for the next launch
    else:
        _epilogue(acc, bias_ptr, out_ptr, rm, rn, N, mask, stride_om, HAS_BIAS)


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_config(M: int, N: int, K: int, device: torch.device) -> GemmConfig:
    """A tile as tall as the rows (64 or 128), 128 wide, and enough K splits for about one
    program per SM, each over at least 512 of K."""
    block_m = 64 if M <= 64 else 128
    block_n, block_k = 128, 64
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    split = max(1, min(num_sms(device) // tiles, K // 512))
    return GemmConfig(block_m, block_n, block_k, split, num_warps=4, num_stages=4)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           config: GemmConfig | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) -> [..., N] in x's dtype, summed in fp32 and
    rounded once. Same bits on every call with the same config and M."""
    return _launch(x, weight, bias, config, glu=False)


def silu_and_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        config: GemmConfig | None = None) -> torch.Tensor:
    """`linear(activation.silu_and_mul(gate_up), weight, bias, config)` in one launch: gate_up
    [..., 2K] (gate, then up), weight [N, K]. The GEMM's loads compute silu(gate) * up, rounded
    as the activation kernel rounds it, so the bits are the two launches' (an MLP's down
    projection without the activation's kernel between it and the gate/up projection)."""
    return _launch(gate_up, weight, bias, config, glu=True)


def _launch(x, weight, bias, config, glu: bool) -> torch.Tensor:
    K = x.shape[-1] // 2 if glu else x.shape[-1]
    N = weight.shape[0]
    width = 2 * K if glu else K
    assert x.shape[-1] == width and weight.shape == (N, K), (
        f"weight {tuple(weight.shape)} does not take inputs of width {x.shape[-1]}"
        + (" (gate and up side by side)" if glu else ""))
    assert weight.dtype == x.dtype, f"{weight.dtype=} != {x.dtype=}"
    assert bias is None or bias.shape == (N,), f"bias {tuple(bias.shape)} != ({N},)"
    x2 = x.reshape(-1, width)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    M = x2.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out.view(*x.shape[:-1], N)
    cfg = config or default_config(M, N, K, x.device)
    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    # Each split a whole number of K blocks; trailing splits with nothing to do are dropped.
    k_per_split = triton.cdiv(triton.cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    split_k = triton.cdiv(K, k_per_split)
    if split_k > 1:
        assert tiles <= MAX_COUNTERS, f"{tiles} output tiles > {MAX_COUNTERS} split-K counters"
        ws = torch.empty(split_k, M, N, dtype=torch.float32, device=x.device)
        tile_counts = counters(x.device, "decode_gemm")
    else:
        ws = tile_counts = out  # unused
    launch_pdl = pdl.enabled(x2)
    _gemm_kernel[(tiles, split_k)](
        x2, weight, bias if bias is not None else weight, out, ws, tile_counts,
        M, N, K, k_per_split, split_k,
        x2.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None,
        GLU=glu,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        PARTIAL=split_k > 1,
        EVEN_K=K % cfg.block_k == 0,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        PDL=launch_pdl,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        launch_pdl=launch_pdl,
    )
    return out.view(*x.shape[:-1], N)
