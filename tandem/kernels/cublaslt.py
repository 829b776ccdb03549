"""cuBLASLt with a chosen algorithm: `y = x @ weight.T` for the decode GEMMs where cuBLAS's own
pick is not its fastest.

`F.linear` runs the first algorithm cuBLAS's heuristic proposes. For some decode shapes another
of the heuristic's own candidates is faster (on an H200, Qwen2.5-1.5B's down projection at 256
rows: split-K 4 with an fp32 reduction, 1.12x). `tandem.bench.gemm` times those candidates and
writes the winner's configuration into the decode GEMM table (`tandem.layers.decode_gemm`); a
layer given one runs it here. A configuration is the algorithm's public config attributes (the
`CUBLASLT_ALGO_CONFIG_*` values): rebuilt with `cublasLtMatmulAlgoInit` and checked with
`cublasLtMatmulAlgoCheck` for each row count before its first use; one the installed cuBLASLt
rejects for a shape falls back to `F.linear`, so a table is never wrong, only slower.

The library is reached through ctypes (the `libcublasLt` torch already loaded), so nothing is
compiled. One plan per (device, M, N, K, dtype, config) holds the descriptors; the workspace is
one buffer per device, allocated before the first capture and shared by every call on the
engine's stream (calls on one stream run in turn).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
from dataclasses import astuple, dataclass

import torch
import torch.nn.functional as F

WORKSPACE_BYTES = 32 << 20
_COMPUTE_32F, _R_32F = 68, 0
_DTYPES = {torch.bfloat16: 14, torch.float16: 2}  # cudaDataType_t
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_PREF_MAX_WORKSPACE = 1
# cublasLtMatmulAlgoConfigAttributes_t, in LtAlgo's field order after algo_id (0)
_CONFIG_ATTRS = (1, 2, 3, 4, 5, 6, 7, 8)
_UINT16_ATTRS = {7, 8}  # inner shape and cluster shape ids are uint16_t


@dataclass(frozen=True)
class LtAlgo:
    """A cuBLASLt algorithm: its id and config attributes (tile, split-K count, its reduction
    scheme, CTA swizzling, custom option, stages, inner shape, cluster shape ids)."""

    algo_id: int
    tile: int
    split_k: int
    reduction: int
    swizzle: int
    custom: int
    stages: int
    inner_shape: int
    cluster: int


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


_VP = ctypes.c_void_p
_SIGNATURES = {
    "cublasLtCreate": [ctypes.POINTER(_VP)],
    "cublasLtGetVersion": [],
    "cublasLtMatmulDescCreate": [ctypes.POINTER(_VP), ctypes.c_int, ctypes.c_int],
    "cublasLtMatmulDescSetAttribute": [_VP, ctypes.c_int, _VP, ctypes.c_size_t],
    "cublasLtMatrixLayoutCreate": [ctypes.POINTER(_VP), ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64,
                                   ctypes.c_int64],
    "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(_VP)],
    "cublasLtMatmulPreferenceDestroy": [_VP],
    "cublasLtMatmulPreferenceSetAttribute": [_VP, ctypes.c_int, _VP, ctypes.c_size_t],
    "cublasLtMatmulAlgoGetHeuristic": [_VP] * 7 + [ctypes.c_int, _VP, ctypes.POINTER(ctypes.c_int)],
    "cublasLtMatmulAlgoInit": [_VP] + [ctypes.c_int] * 7 + [_VP],
    "cublasLtMatmulAlgoConfigSetAttribute": [_VP, ctypes.c_int, _VP, ctypes.c_size_t],
    "cublasLtMatmulAlgoConfigGetAttribute": [_VP, ctypes.c_int, _VP, ctypes.c_size_t,
                                             ctypes.POINTER(ctypes.c_size_t)],
    "cublasLtMatmulAlgoCheck": [_VP] * 8,
    "cublasLtMatmul": [_VP] * 14 + [ctypes.c_size_t, _VP],
}


@functools.cache
def _lib():
    """torch's libcublasLt (already loaded by its CUDA build), or None without one."""
    if not torch.cuda.is_available():
        return None
    names = ["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"]
    site = os.path.dirname(os.path.dirname(torch.__file__))
    names += sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libcublasLt.so*")))
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        for fn, args in _SIGNATURES.items():
            getattr(lib, fn).argtypes = args
            getattr(lib, fn).restype = ctypes.c_size_t if fn == "cublasLtGetVersion" else ctypes.c_int
        return lib
    return None


def available() -> bool:
    return _lib() is not None


def version() -> int | None:
    lib = _lib()
    return int(lib.cublasLtGetVersion()) if lib is not None else None


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _attr(attr: int, value: int = 0) -> tuple[ctypes._SimpleCData, int]:
    """A config attribute's value as cuBLASLt reads it, and its size (uint16 or uint32)."""
    return (ctypes.c_uint16(value), 2) if attr in _UINT16_ATTRS else (ctypes.c_uint32(value), 4)


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} failed (cublasStatus_t {status})")


@functools.cache
def _handle(device_index: int) -> int:
    h = _VP()
    with torch.cuda.device(device_index):
        _check(_lib().cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
    return h.value


@functools.cache
def _workspace(device_index: int) -> torch.Tensor:
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=torch.device("cuda", device_index))


def prepare(device: torch.device) -> None:
    """Create the device's handle and workspace now: before any CUDA graph capture, so the
    workspace is ordinary memory rather than part of a graph's pool."""
    _handle(_index(device))
    _workspace(_index(device))


class _Plan:
    """Descriptors for x [M, K] @ weight [N, K].T -> y [M, N], all row-major, in cuBLASLt's
    column-major terms: D [N, M] = op_T(weight as [K, N]) @ x as [K, M]."""

    def __init__(self, device_index: int, m: int, n: int, k: int, dtype: torch.dtype):
        lib, dt = _lib(), _DTYPES[dtype]
        self.handle = _handle(device_index)
        self.desc = _VP()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _R_32F), "desc")
        for attr, op in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N)):
            v = ctypes.c_int32(op)
            _check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), 4), "desc attribute")
        self.a, self.b, self.d = _VP(), _VP(), _VP()
        for layout, rows, cols in ((self.a, k, n), (self.b, k, m), (self.d, n, m)):
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dt, rows, cols, rows), "layout")
        self.one, self.zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self.workspace = _workspace(device_index)

    def heuristics(self, count: int) -> list[_Algo]:
        lib = _lib()
        pref = _VP()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        try:
            ws = ctypes.c_uint64(WORKSPACE_BYTES)
            _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE, ctypes.byref(ws), 8),
                   "preference attribute")
            results = (_Heuristic * count)()
            got = ctypes.c_int(0)
            _check(lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, self.a, self.b, self.d, self.d,
                                                      pref, count, results, ctypes.byref(got)), "heuristic")
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        return [results[i].algo for i in range(got.value) if results[i].state == 0]

    def build(self, algo: LtAlgo, dtype: torch.dtype) -> _Algo | None:
        """`algo` as cuBLASLt's struct, or None where this cuBLASLt rejects it for this shape."""
        lib, dt = _lib(), _DTYPES[dtype]
        a = _Algo()
        if lib.cublasLtMatmulAlgoInit(self.handle, _COMPUTE_32F, _R_32F, dt, dt, dt, dt, algo.algo_id,
                                      ctypes.byref(a)) != 0:
            return None
        for attr, value in zip(_CONFIG_ATTRS, astuple(algo)[1:]):
            v, size = _attr(attr, value)
            if lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(a), attr, ctypes.byref(v), size) != 0:
                return None
        result = _Heuristic()
        status = lib.cublasLtMatmulAlgoCheck(self.handle, self.desc, self.a, self.b, self.d, self.d,
                                             ctypes.byref(a), ctypes.byref(result))
        if status != 0 or result.state != 0 or result.workspace_size > WORKSPACE_BYTES:
            return None
        return a

    def run(self, algo: _Algo, x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor) -> None:
        stream = torch.cuda.current_stream(x.device).cuda_stream
        _check(_lib().cublasLtMatmul(
            self.handle, self.desc, ctypes.byref(self.one), weight.data_ptr(), self.a, x.data_ptr(), self.b,
            ctypes.byref(self.zero), y.data_ptr(), self.d, y.data_ptr(), self.d, ctypes.byref(algo),
            self.workspace.data_ptr(), WORKSPACE_BYTES, stream), "cublasLtMatmul")


def describe(algo: _Algo) -> LtAlgo:
    """The config attributes of one of cuBLASLt's algorithm structs."""
    lib = _lib()
    values = []
    for attr in (0, *_CONFIG_ATTRS):
        v, size = _attr(attr)
        written = ctypes.c_size_t(0)
        _check(lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(v), size,
                                                        ctypes.byref(written)), "config attribute")
        values.append(int(v.value))
    return LtAlgo(*values)


@functools.cache
def _plan(device_index: int, m: int, n: int, k: int, dtype: torch.dtype) -> _Plan:
    return _Plan(device_index, m, n, k, dtype)


@functools.cache
def _built(device_index: int, m: int, n: int, k: int, dtype: torch.dtype,
           algo: LtAlgo) -> tuple[_Plan, _Algo] | None:
    """The shape's plan and `algo` built for it, or None where this cuBLASLt rejects it."""
    plan = _plan(device_index, m, n, k, dtype)
    built = plan.build(algo, dtype)
    return (plan, built) if built is not None else None


def heuristic_algos(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device,
                    count: int = 8) -> list[LtAlgo]:
    """The first `count` algorithms cuBLASLt's heuristic proposes for x [m, k] @ weight [n, k].T
    (its first is the one `F.linear` runs): the candidates `tandem.bench.gemm` times."""
    return [describe(a) for a in _plan(_index(device), m, n, k, dtype).heuristics(count)]


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.is_cuda and x.dtype in _DTYPES and weight.dtype == x.dtype and available()
            and x.is_contiguous() and weight.is_contiguous())


def linear(x: torch.Tensor, weight: torch.Tensor, algo: LtAlgo) -> torch.Tensor:
    """x @ weight.T with `algo` (no bias); `F.linear` where this cuBLASLt rejects `algo` for the
    shape or the inputs are not contiguous CUDA bf16/fp16."""
    if not supports(x, weight):
        return F.linear(x, weight)
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    built = _built(_index(x.device), m, n, k, x.dtype, algo) if m > 0 else None
    if built is None:
        return F.linear(x, weight)
    plan, struct = built
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    plan.run(struct, x2, weight, y)
    return y.view(*x.shape[:-1], n)
