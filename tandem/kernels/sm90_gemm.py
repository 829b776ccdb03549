"""Hopper's own GEMM for decode's few rows: `x @ W.T (+ bias)` with thread-block clusters.

Reference: `decode_gemm_ref.linear_ref`. The kernel (`sm90_gemm.cu`, CUDA C++ with inline PTX,
compiled at first use by NVRTC and launched through the driver: `tandem.kernels.cuda_driver`)
does what cuBLAS's Hopper kernels do and Triton 3.6 cannot express: the CTAs of a cluster that
share a weight tile get it by one TMA multicast, and the CTAs that split K add their partial sums
through distributed shared memory (no workspace, no second kernel). Why it is here: at 256 rows
the decode step's small GEMMs (q/k/v, o, the down projection) run at 25-47% of the H200's
measured peak under cuBLAS (docs/benchmarks.md), and a split-K reduced in the cluster removes
cuBLAS's separate reduction kernel. The decode GEMM table (`tandem.layers.decode_gemm`) picks it
per shape and row bucket only where `python -m tandem.bench.gemm` measured it faster than cuBLAS
and bit-stable (the H200 table shipped in tandem/kernels/configs names it for few rows).

A config names the tile (64, 128, 192 or 256 rows: one to four consumer warpgroups of
`warpgroup_m` = 64 or 128 rows; `block_n` columns, as many as the accumulators' registers
allow), the pipeline depth, how many M tiles share each weight tile by multicast (`cluster_m`),
how many N tiles share each x tile (`cluster_n`: every N tile reads all of x from L2, at 256
rows twice the weight's own bytes on Qwen2.5-1.5B's gate/up with 128-wide tiles) and the K
splits (`split_k`, reduced in the cluster, in split order: the same bits on every run). Needs
compute capability 9.0, bf16 or fp16, N a multiple of 8 and K of 8 (TMA's 16-byte row strides).
`gate_up_silu` is the same GEMM for an MLP's merged gate/up weight with SiLU-and-mul in its
epilogue (an `Sm90GluConfig`: a table entry `sm90-glu`, run by `layers.linear.apply_mlp`).

For work on the kernel, `phase_timeline` runs a build that stamps %globaltimer at each phase of
each CTA and `phase_durations` reads the stamps (how the 256-row epilogue's 7 us were found):

    out, stamps = sm90_gemm.phase_timeline(x, w, None, Sm90GemmConfig(256, 136, 4, 1, 1, 2, 128))
    {k: v.median().item() for k, v in sm90_gemm.phase_durations(stamps, split=False).items()}
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
from dataclasses import dataclass

import torch

from tandem.kernels import pdl
from tandem.kernels.decode_gemm_ref import linear_ref  # noqa: F401 (the reference)

BLOCK_K = 64
PRODUCER_REGISTERS = 40  # the producer warpgroup's registers a thread after `setmaxnreg.dec`
OTHER_REGISTERS = 28  # a consumer thread's registers besides its accumulators (about)
MAX_SHARED = 227 * 1024  # an H100/H200 block's dynamic shared memory limit
_SOURCE = os.path.join(os.path.dirname(__file__), "sm90_gemm.cu")
_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16"}
# Bring-up aid: a barrier wait that spins 2**26 times traps (the launch fails with an error)
# instead of hanging the GPU; `TANDEM_SM90_WATCHDOG=1`, read at import.
WATCHDOG = os.environ.get("TANDEM_SM90_WATCHDOG", "0") == "1"


@dataclass(frozen=True)
class Sm90GemmConfig:
    """One launch configuration (`default_config` picks one from shapes)."""

    block_m: int = 128  # warpgroup_m x consumer warpgroups
    block_n: int = 128
    stages: int = 4
    cluster_m: int = 1  # M tiles sharing each weight tile by TMA multicast
    split_k: int = 1  # K splits, one cluster, reduced through distributed shared memory
    cluster_n: int = 1  # N tiles sharing each x tile by TMA multicast
    warpgroup_m: int = 64  # rows a consumer warpgroup computes: one or two wgmmas of 64 a k step

    def __post_init__(self):
        problems = []
        if self.warpgroup_m not in (64, 128):
            problems.append(f"warpgroup_m={self.warpgroup_m} (64 or 128 rows a consumer warpgroup)")
        elif self.block_m not in (64, 128, 192, 256) or self.block_m % self.warpgroup_m:
            problems.append(f"block_m={self.block_m} (64, 128, 192 or 256, a multiple of "
                            f"warpgroup_m={self.warpgroup_m}: one to four consumer warpgroups)")
        elif self.accumulators > self.consumer_registers - OTHER_REGISTERS:
            most = (self.consumer_registers - OTHER_REGISTERS) * 128 // self.warpgroup_m
            problems.append(f"block_n={self.block_n} with block_m={self.block_m} (its "
                            f"{self.accumulators} accumulators a thread and the kernel's "
                            f"~{OTHER_REGISTERS} other "
                            f"registers exceed the {self.consumer_registers} a consumer thread "
                            f"gets of {self.threads} threads: at most {most // 8 * 8})")
        if not (8 <= self.block_n <= 256 and self.block_n % 8 == 0):
            problems.append(f"block_n={self.block_n} (a multiple of 8 from 8 to 256: wgmma's n)")
        if self.cluster_m not in (1, 2, 4) or (self.block_n // self.cluster_m) % 8:
            problems.append(f"cluster_m={self.cluster_m} (1, 2 or 4, each CTA's share of block_n "
                            "a multiple of 8 rows)")
        if self.cluster_n not in (1, 2, 4) or (self.block_m // self.cluster_n) % 8:
            problems.append(f"cluster_n={self.cluster_n} (1, 2 or 4, each CTA's share of block_m "
                            "a multiple of 8 rows)")
        if not 1 <= self.split_k <= 16:
            problems.append(f"split_k={self.split_k} (1 to 16)")
        if self.cluster_size > 16:
            problems.append(f"cluster_m x cluster_n x split_k = {self.cluster_size} (a cluster "
                            "holds at most 16 CTAs)")
        if self.stages < 2:
            problems.append(f"stages={self.stages} (at least 2)")
        if self.shared_bytes() > MAX_SHARED:
            problems.append(f"shared memory {self.shared_bytes()} bytes > {MAX_SHARED} (fewer "
                            "stages or a narrower tile)")
        if problems:
            raise ValueError("Sm90GemmConfig: " + "; ".join(problems))

    @property
    def consumers(self) -> int:
        return self.block_m // self.warpgroup_m

    @property
    def accumulators(self) -> int:
        """fp32 accumulators a consumer thread holds: its warpgroup's rows x block_n / 128."""
        return self.warpgroup_m * self.block_n // 128

    @property
    def threads(self) -> int:
        return 128 * (self.consumers + 1)

    @property
    def launch_registers(self) -> int:
        """Registers a thread gets with one block an SM (65,536 a block, 8 at a time, <= 255)."""
        return min(255, 65536 // self.threads // 8 * 8)

    @property
    def consumer_registers(self) -> int:
        """Registers a consumer thread works with. With two consumer warpgroups the producer's
        (one thread issues its loads) go down to PRODUCER_REGISTERS and the consumers take the
        rest (`setmaxnreg`): 232 each instead of the 168 a thread of 384 gets at launch. Not with
        three or four: ptxas (CUDA 13.0) compiles their wgmma to the launch's 128 or 96 all the
        same (C7602 'insufficient registers')."""
        if self.consumers != 2:
            return self.launch_registers
        spare = self.launch_registers * self.threads - PRODUCER_REGISTERS * 128
        return spare // (128 * self.consumers) // 8 * 8

    @property
    def reallocates_registers(self) -> bool:
        """Whether the kernel hands the producer's registers to the consumers: only where the
        accumulators need more than a thread gets at launch (the others' machine code stays
        that of the kernel without it)."""
        return self.consumers == 2 and self.accumulators > self.launch_registers - OTHER_REGISTERS

    @property
    def cluster_size(self) -> int:
        return self.cluster_m * self.cluster_n * self.split_k

    def shared_bytes(self) -> int:
        """The kernel's dynamic shared memory: the stages (with the partial sums, split, or the
        output tile, unsplit, laid over them), the barriers and 1 KiB to align the swizzled
        tiles."""
        pipe = self.stages * (self.block_m + self.block_n) * BLOCK_K * 2
        red = self.block_m * (self.block_n + 8) * 4 if self.split_k > 1 else 0
        out = self.block_m * self.out_stride if self.split_k == 1 else 0
        return max(pipe, red, out) + 16 * self.stages + 1024

    @property
    def out_cols(self) -> int:
        """Output columns a tile."""
        return self.block_n

    @property
    def out_stride(self) -> int:
        """Bytes a row of the output tile staged in shared memory (unsplit): padded so a warp's
        stores of 8 rows' pairs hit distinct banks (the kernel's OUT_STRIDE)."""
        return self.out_cols * 2 + (16 if (self.out_cols // 2) % 8 == 0 else 0)


@dataclass(frozen=True)
class Sm90GluConfig(Sm90GemmConfig):
    """A config for an MLP's gate/up GEMM with SiLU-and-mul in its epilogue (`gate_up_silu`):
    `block_n` weight rows a tile, half of them gate rows, so a multiple of 16."""

    @property
    def out_cols(self) -> int:
        return self.block_n // 2  # (the gate and up columns give one output column)

    def __post_init__(self):
        super().__post_init__()
        if self.block_n % 16:
            raise ValueError(f"Sm90GluConfig: block_n={self.block_n} (a multiple of 16: half of it "
                             "gate rows, a multiple of 8)")


def unsupported(N: int, K: int, dtype: torch.dtype) -> str | None:
    """Why this kernel cannot multiply by an [N, K] weight of `dtype` (None: it can)."""
    if dtype not in _DTYPES:
        return f"dtype {dtype} (bf16 or fp16)"
    if N % 8:
        return f"N={N} (a multiple of 8)"
    if K % 8:
        return f"K={K} (a multiple of 8: TMA's rows are 16-byte aligned)"
    return None


def device_supported(device: torch.device) -> bool:
    """A Hopper GPU (sm_90: wgmma, TMA multicast, clusters) with NVRTC and the driver reachable."""
    from tandem.kernels import cuda_driver

    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return (torch.cuda.get_device_capability(device) == (9, 0) and cuda_driver.driver_available()
            and cuda_driver.nvrtc_available())


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_config(M: int, N: int, K: int, sms: int = 132, glu: bool = False) -> Sm90GemmConfig:
    """Tiles as tall as the rows allow (64 or 128), and the tile width (128, 96 or 64 columns;
    with `glu`, 256, 192, 144, 128 or 96 weight rows for half as many output columns) whose K
    splits (each at least 2 blocks of K; at most 8 to a cluster with 64-row tiles, 4 with 128-row
    ones) keep the SMs busiest: CTAs over whole waves of `sms`. No multicast: on an H200
    (2026-12-05, `bench gemm`) every config sharing a weight tile between two M tiles ran slower
    than the same without, and clusters of 8 one-CTA-an-SM blocks (128-row tiles) up to 2x slower
    than clusters of 4 (fewer of them fit at once)."""
    block_m = 64 if M <= 64 else 128
    tiles_m = -(-M // block_m)
    cluster_m = 1
    max_cluster = 8 if block_m == 64 else 4
    k_blocks = -(-K // BLOCK_K)
    best = None
    for block_n in ((256, 192, 144, 128, 96) if glu else (128, 96, 64)):
        tiles = tiles_m * -(-N // (block_n // 2 if glu else block_n))
        split = 1
        while (split * 2 <= max_cluster and tiles * split * 2 <= sms
               and k_blocks // (split * 2) >= 2):
            split *= 2
        ctas = tiles * split
        busy = ctas / (-(-ctas // sms) * sms)
        if best is None or busy > best[0]:
            best = (busy, (Sm90GluConfig if glu else Sm90GemmConfig)(block_m, block_n, 4, cluster_m, split))
    return best[1]


def source(cfg: Sm90GemmConfig, dtype: torch.dtype, has_bias: bool, glu: bool = False,
           timeline: bool = False) -> str:
    """The kernel's CUDA source for a config: its macros, its wgmma for `block_n`, the kernel
    (with `timeline`, the build that stamps its phases: `phase_timeline`)."""
    if glu and cfg.block_n % 16:
        raise ValueError(f"block_n={cfg.block_n}: with the activation fused, half of it (the gate "
                         "columns) must be a multiple of 8")
    t = _DTYPES[dtype]
    macros = {"BM": cfg.block_m, "BN": cfg.block_n, "STAGES": cfg.stages, "CONSUMERS": cfg.consumers,
              "MSUB": cfg.warpgroup_m // 64,
              "CLUSTER_M": cfg.cluster_m, "CLUSTER_N": cfg.cluster_n, "SPLIT_K": cfg.split_k,
              "HAS_BIAS": int(has_bias),
              "ELEM_BF16": int(dtype == torch.bfloat16), "GLU": int(glu), "SM90_WATCHDOG": int(WATCHDOG),
              "SM90_TIMELINE": int(timeline), "TIMELINE_SLOTS": TIMELINE_SLOTS, "SM_SLOT": SM_SLOT,
              "PRODUCER_REGS": PRODUCER_REGISTERS,
              "CONSUMER_REGS": cfg.consumer_registers if cfg.reallocates_registers else 0}
    head = "".join(f"#define {k} {v}\n" for k, v in macros.items())
    with open(_SOURCE) as f:
        kernel = f.read()
    # wgmma_tile goes after the helpers (its types), before the kernel.
    at = kernel.index('extern "C"')
    return head + kernel[:at] + _wgmma_source(cfg.block_n, t) + "\n" + kernel[at:]


def _wgmma_source(n: int, t: str) -> str:
    """`wgmma_tile(acc, desc_a, desc_b)`: acc[n/2] += A (64 x 16, shared) @ B (n x 16, shared)^T,
    both K-major; its n/2 accumulator registers spelled out, as inline PTX needs them."""
    regs = n // 2
    d = ", ".join(f"%{i}" for i in range(regs))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    return (
        f"__device__ __forceinline__ void wgmma_tile(float (&d)[{regs}], u64 desc_a, u64 desc_b) {{\n"
        f'  asm volatile("{{\\n\\t.reg .pred p;\\n\\tsetp.ne.b32 p, %{regs + 2}, 0;\\n\\t"\n'
        f'               "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{t}.{t} "\n'
        f'               "{{{d}}}, %{regs}, %{regs + 1}, p, 1, 1, 0, 0;\\n\\t}}"\n'
        f"               : {outs}\n"
        f'               : "l"(desc_a), "l"(desc_b), "r"(1));\n'
        "}\n")


def _compile(src: str) -> None:
    from tandem.kernels import cuda_driver

    cuda_driver.compile_cubin(src)


def precompile(variants, jobs: int | None = None) -> int:
    """Compile the kernels of `variants` ((config, dtype, has_bias, glu) each) into the disk cache
    in `jobs` processes (default: one a CPU), so a sweep over hundreds of configs does not compile
    them one by one; a variant NVRTC rejects is left for its own launch to report. Returns how
    many sources there were. The processes are spawned: a script calls it under
    `if __name__ == "__main__":` (as `python -m tandem.bench.gemm` does)."""
    import concurrent.futures
    import multiprocessing

    sources = list(dict.fromkeys(source(c, dt, b, g) for c, dt, b, g in variants))
    jobs = jobs or os.cpu_count() or 1
    if len(sources) < 2 or jobs < 2:
        return len(sources)
    with concurrent.futures.ProcessPoolExecutor(
            min(jobs, len(sources)), mp_context=multiprocessing.get_context("spawn")) as pool:
        for f in [pool.submit(_compile, src) for src in sources]:
            f.exception()  # (the launch compiles it again and raises)
    return len(sources)


@functools.cache
def _kernel(cfg: Sm90GemmConfig, dtype: torch.dtype, has_bias: bool, glu: bool, timeline: bool = False):
    from tandem.kernels import cuda_driver

    return cuda_driver.Kernel(cuda_driver.compile_cubin(source(cfg, dtype, has_bias, glu, timeline)),
                              "tandem_sm90_gemm")


_MAPS: dict[tuple, object] = {}  # (address, shape, row stride, dtype, box rows) -> TensorMap
_MAX_MAPS = 4096


def _tensor_map(t: torch.Tensor, box_rows: int):
    """The TMA map of a 2-D tensor's [box_rows, 64] tiles, 128-byte swizzled (wgmma's layout).
    Cached by address and shape: a CUDA graph's inputs keep theirs, and weights never move."""
    from tandem.kernels import cuda_driver

    key = (t.data_ptr(), tuple(t.shape), t.stride(0), t.dtype, box_rows, t.device)
    tmap = _MAPS.get(key)
    if tmap is None:
        if len(_MAPS) >= _MAX_MAPS:
            _MAPS.clear()
        tmap = _MAPS[key] = cuda_driver.tensor_map_2d(t, box_rows, BLOCK_K, swizzle_bytes=128)
    return tmap


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           config: Sm90GemmConfig | None = None, static_weight: bool = False) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) -> [..., N] in x's dtype, summed in fp32 and
    rounded once (the bias added before rounding). Same bits on every call with the same config
    and M. `static_weight`: the weight was not written by the kernel launched right before this
    one (a model's parameter during a step), so with programmatic dependent launch its first
    tiles load while that kernel finishes."""
    return _launch(x, weight, bias, config, glu=False, static_weight=static_weight)


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 config: Sm90GemmConfig | None = None, static_weight: bool = False) -> torch.Tensor:
    """`activation.silu_and_mul(linear(x, weight, bias, config))` in one launch: weight [2N, K]
    (an MLP's gate rows, then its up rows) -> [..., N]. The products are rounded as `linear`
    rounds them and the activation computed as the activation kernel computes it, so the bits
    are the two launches' (for a `linear` config of the same rows and K splits); no [.., 2N]
    intermediate is written. `config.block_n` counts both halves (a multiple of 16);
    `static_weight` as `linear` takes it."""
    return _launch(x, weight, bias, config, glu=True, static_weight=static_weight)


def grid(cfg: Sm90GemmConfig, M: int, N: int, glu: bool = False) -> tuple[int, int, int]:
    """The launch grid (M tiles, N tiles, K splits) of M rows and N output columns: whole
    clusters (tiles past the rows or columns compute nothing that is stored)."""
    tiles_m = -(-M // cfg.block_m)
    tiles_n = -(-N // (cfg.block_n // 2 if glu else cfg.block_n))
    return (-(-tiles_m // cfg.cluster_m) * cfg.cluster_m, -(-tiles_n // cfg.cluster_n) * cfg.cluster_n,
            cfg.split_k)


def _launch(x, weight, bias, config, glu: bool, static_weight: bool,
            timeline: torch.Tensor | None = None) -> torch.Tensor:
    K = x.shape[-1]
    rows = weight.shape[0]
    N = rows // 2 if glu else rows
    if weight.shape != (rows, K) or weight.dtype != x.dtype or (glu and rows % 2):
        raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} does not take x "
                         f"[..., {K}] {x.dtype}" + (" (gate and up rows: an even count)" if glu else ""))
    if bias is not None and (bias.shape != (rows,) or bias.dtype != x.dtype):
        raise ValueError(f"bias {tuple(bias.shape)} {bias.dtype}: want ({rows},) {x.dtype}")
    why = unsupported(N, K, x.dtype)
    if why is not None:
        raise ValueError(f"sm90_gemm: unsupported {why}")
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1 or (x2.stride(0) * x2.element_size()) % 16 or x2.data_ptr() % 16:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
        static_weight = False  # written by the copy right before
    if bias is not None:
        bias = bias.contiguous()  # read as [2N] or [N] contiguous
    M = x2.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out.view(*x.shape[:-1], N)
    cfg = config or default_config(M, N, K, num_sms(x.device), glu=glu)
    launch_grid = grid(cfg, M, N, glu)
    if timeline is not None and (timeline.shape != (math.prod(launch_grid), TIMELINE_SLOTS)
                                 or timeline.dtype != torch.int64 or timeline.device != x.device):
        raise ValueError(f"timeline: want int64 [{math.prod(launch_grid)}, {TIMELINE_SLOTS}] on "
                         f"{x.device} (a row a CTA), got {timeline.dtype} {tuple(timeline.shape)} "
                         f"on {timeline.device}")
    share = cfg.block_n // cfg.cluster_m
    w_box = min(share, cfg.block_n // 2) if glu else share  # the kernel's W_BOX
    args = [_tensor_map(x2, cfg.block_m // cfg.cluster_n), _tensor_map(weight, w_box), out,
            bias if bias is not None else weight, ctypes.c_int32(M), ctypes.c_int32(N), ctypes.c_int32(K),
            ctypes.c_int32(int(static_weight))] + ([timeline] if timeline is not None else [])
    _kernel(cfg, x.dtype, bias is not None, glu, timeline is not None).launch(
        launch_grid, (cfg.threads, 1, 1), args,
        shared_mem=cfg.shared_bytes(), cluster=(cfg.cluster_m, cfg.cluster_n, cfg.split_k),
        pdl=pdl.enabled(x2),
        device=x.device)
    return out.view(*x.shape[:-1], N)


# `phase_timeline`: the slots the kernel's SM90_TIMELINE build stamps with %globaltimer (ns), a
# row a CTA; slot 7 is the staged tile unsplit, the partial sums in shared memory split.
TIMELINE_SLOTS = 16
PHASES = {
    0: "entry", 1: "barriers set up", 2: "kernel before done", 3: "loads issued",
    4: "first stage in", 5: "first consumer done", 6: "last consumer done",
    7: "tile staged / partials stored", 8: "stores issued", 9: "all splits' partials ready",
    10: "rows reduced", 11: "leaving",
}
SM_SLOT = 15  # the SM the CTA ran on


def phase_timeline(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   config: Sm90GemmConfig | None = None, glu: bool = False,
                   static_weight: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each CTA's time goes: the GEMM (`linear`, or with `glu` `gate_up_silu`) by the build
    of the kernel that stamps %globaltimer at each phase. Returns (its output, the same bits as
    the plain build's; int64 [CTAs, TIMELINE_SLOTS] nanoseconds, slot SM_SLOT the SM, unstamped
    slots 0). For kernel work, not for a step: the stamps' stores cost a little. The timer ticks
    in steps the GPU sets (0.256 us measured on an H100 and an H200)."""
    K = x.shape[-1]
    M = x.reshape(-1, K).shape[0]
    N = weight.shape[0] // (2 if glu else 1)
    cfg = config or default_config(M, N, K, num_sms(x.device), glu=glu)
    stamps = torch.zeros(math.prod(grid(cfg, M, N, glu)), TIMELINE_SLOTS, dtype=torch.int64,
                         device=x.device)
    out = _launch(x, weight, bias, cfg, glu, static_weight, timeline=stamps)
    return out, stamps


def phase_durations(stamps: torch.Tensor, split: bool) -> dict[str, torch.Tensor]:
    """Each CTA's phases (microseconds, a tensor of CTAs each) from `phase_timeline`'s stamps:
    set-up, the wait for the kernel before, the fill (to the first stage in), the mainloop, then
    unsplit the staging and the stores, split the partial sums' stores, the wait for every
    split, the reduction and the last barrier; and each CTA's start after the first CTA's."""
    t = stamps.double() / 1e3
    d = {"start after the first CTA": t[:, 0] - t[:, 0].min(),
         "set-up": t[:, 1] - t[:, 0],
         "wait for the kernel before": t[:, 2] - t[:, 1],
         "fill (to the first stage)": t[:, 4] - t[:, 1],
         "mainloop": t[:, 5] - t[:, 4],
         "last consumer after the first": t[:, 6] - t[:, 5]}
    if split:
        d.update({"partial sums stored": t[:, 7] - t[:, 5],
                  "wait for every split": t[:, 9] - t[:, 7],
                  "reduction": t[:, 10] - t[:, 9],
                  "last barrier": t[:, 11] - t[:, 10]})
    else:
        d.update({"tile staged": t[:, 7] - t[:, 5],
                  "stores": t[:, 8] - t[:, 7],
                  "to the end": t[:, 11] - t[:, 8]})
    d["total"] = t[:, 11] - t[:, 0]
    return d
