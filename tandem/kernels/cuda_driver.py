"""CUDA C++ kernels compiled at run time by NVRTC and launched through the CUDA driver API.

Some kernels need what Triton does not expose (Hopper's TMA loads into a chosen shared-memory
layout, thread-block clusters, `wgmma` through inline PTX). They are written as CUDA C++ without
any `#include` (inline PTX for the Hopper instructions) and compiled here, at run time, by the
NVRTC library that torch's CUDA build ships (the `nvidia-cuda-nvrtc` wheel); the cubin is
loaded and launched through the driver (`libcuda.so.1`, which torch already loaded). Both are
reached through ctypes, so there is no compiled extension and nothing to build at install.

- `compile_cubin`: NVRTC, cached in-process and on disk (`$TANDEM_CACHE/cubin/<sha256>.cubin`,
  else `${XDG_CACHE_HOME:-~/.cache}/tandem/cubin`), keyed by the source, arch, options and
  NVRTC's version; written through a temporary file and a rename, so a crash never leaves a
  partial cubin that a later run loads.
- `Kernel(cubin, name).launch(grid, block, args, ...)`: `cuLaunchKernelEx` on torch's current
  stream (so a launch inside `torch.cuda.graph` is captured), with an optional cluster shape and
  programmatic dependent launch. Tensors pass as their data pointers, a `TensorMap` by value,
  scalars as explicit ctypes values (the kernel's parameter width is never guessed).
- `tensor_map_2d`: a TMA descriptor (`CUtensorMap`) for a 2-D row-major tile of a tensor.
- `nvcc_cubin`, `cuobjdump_sass`, `ptxas_resource_usage`: the same source through the `nvcc`
  binary, for tests on machines without a GPU (does the Hopper path compile, what SASS, how
  many registers). nvcc has no `-default-device`: mark helper functions `__device__`, so one
  source compiles with both.

Enum values and struct layouts are those of the CUDA 13 `cuda.h` (the tests compare them with
the header where one is installed).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence

import torch

_VP = ctypes.c_void_p
_PTR_VP = ctypes.POINTER(_VP)
_PORTABLE_CLUSTER = 8  # a cluster of more blocks needs the non-portable attribute
_ELF_MAGIC = b"\x7fELF"

# CUfunction_attribute
_FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_FUNC_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
# CUlaunchAttributeID
_LAUNCH_ATTR_CLUSTER_DIMENSION = 4
_LAUNCH_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6
# CUtensorMapDataType of each dtype a map takes
_TMAP_DTYPES = {torch.float16: 6, torch.float32: 7, torch.bfloat16: 9}
_TMAP_INTERLEAVE_NONE = 0
_TMAP_SWIZZLES = {0: 0, 32: 1, 64: 2, 128: 3}  # swizzle bytes -> CUtensorMapSwizzle
_TMAP_L2_PROMOTION_256B = 3
_TMAP_OOB_FILL_NONE = 0  # out-of-bounds elements read as zero
_TMAP_BYTES = 128  # sizeof(CUtensorMap): 16 x cuuint64_t
_TMAP_ALIGN = 128  # alignas(128) in cuda.h (the driver asks for 64)


class CudaError(RuntimeError):
    """A CUDA driver, NVRTC or nvcc call failed; the message names the call and the error."""


class _ClusterDim(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


class _LaunchAttrValue(ctypes.Union):
    """CUlaunchAttributeValue: a 64-byte union (8-byte aligned: some members hold pointers)."""

    _fields_ = [("pad", ctypes.c_char * 64), ("cluster_dim", _ClusterDim), ("flag", ctypes.c_int),
                ("align", ctypes.c_uint64)]


class _LaunchAttr(ctypes.Structure):
    """CUlaunchAttribute: the id (an enum, 4 bytes), 4 bytes of padding, the value."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttrValue)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""

    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_mem_bytes", ctypes.c_uint), ("stream", _VP),
                ("attrs", ctypes.POINTER(_LaunchAttr)), ("num_attrs", ctypes.c_uint)]


_U64P, _U32P = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
_DRIVER_SIGNATURES = {
    "cuInit": [ctypes.c_uint],
    "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
    "cuDevicePrimaryCtxRetain": [_PTR_VP, ctypes.c_int],
    "cuCtxGetCurrent": [_PTR_VP],
    "cuCtxSetCurrent": [_VP],
    "cuCtxPushCurrent_v2": [_VP],
    "cuCtxPopCurrent_v2": [_PTR_VP],
    "cuModuleLoadData": [_PTR_VP, ctypes.c_char_p],
    "cuModuleGetFunction": [_PTR_VP, _VP, ctypes.c_char_p],
    "cuFuncSetAttribute": [_VP, ctypes.c_int, ctypes.c_int],
    "cuLaunchKernelEx": [ctypes.POINTER(_LaunchConfig), _VP, _PTR_VP, _PTR_VP],
    "cuTensorMapEncodeTiled": [_VP, ctypes.c_int, ctypes.c_uint32, _VP, _U64P, _U64P, _U32P, _U32P,
                               ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int],
}
_NVRTC_SIGNATURES = {
    "nvrtcVersion": [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)],
    "nvrtcCreateProgram": [_PTR_VP, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
                           ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_char_p)],
    "nvrtcDestroyProgram": [_PTR_VP],
    "nvrtcCompileProgram": [_VP, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    "nvrtcGetProgramLogSize": [_VP, ctypes.POINTER(ctypes.c_size_t)],
    "nvrtcGetProgramLog": [_VP, ctypes.c_char_p],
    "nvrtcGetCUBINSize": [_VP, ctypes.POINTER(ctypes.c_size_t)],
    "nvrtcGetCUBIN": [_VP, ctypes.c_char_p],
    "nvrtcGetErrorString": [ctypes.c_int],
}


def _bind(lib: ctypes.CDLL, signatures: dict) -> ctypes.CDLL:
    for fn, args in signatures.items():
        getattr(lib, fn).argtypes = args
        getattr(lib, fn).restype = ctypes.c_int
    return lib


# ---------------------------------------------------------------------------------------------
# the libraries


@functools.cache
def _driver():
    """libcuda (torch's CUDA build already loaded it), or None without one."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    return _bind(lib, _DRIVER_SIGNATURES)


def driver_available() -> bool:
    return torch.cuda.is_available() and _driver() is not None


def _nvrtc_candidates() -> list[str]:
    """torch's own NVRTC wheel first (the one matching torch's CUDA major version ahead), then the
    loader path."""
    site = os.path.dirname(os.path.dirname(torch.__file__))
    found = sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libnvrtc.so*")))
    major = (torch.version.cuda or "").split(".")[0]
    found.sort(key=lambda p: not (major and f".so.{major}" in os.path.basename(p)))
    return found + ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]


@functools.cache
def _nvrtc():
    """libnvrtc, or None where none is found (NVRTC needs no GPU: it compiles on any machine)."""
    for name in _nvrtc_candidates():
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        _bind(lib, _NVRTC_SIGNATURES)
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        return lib
    return None


def nvrtc_available() -> bool:
    return _nvrtc() is not None


@functools.cache
def nvrtc_version() -> tuple[int, int] | None:
    lib = _nvrtc()
    if lib is None:
        return None
    major, minor = ctypes.c_int(), ctypes.c_int()
    _nvrtc_check(lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def _require_driver() -> ctypes.CDLL:
    lib = _driver() if torch.cuda.is_available() else None
    if lib is None:
        raise CudaError("no CUDA driver: libcuda.so.1 did not load or torch.cuda.is_available() is "
                        "False; CUDA kernels need a GPU")
    return lib


def _require_nvrtc() -> ctypes.CDLL:
    lib = _nvrtc()
    if lib is None:
        raise CudaError("NVRTC not found: no libnvrtc.so* under torch's site-packages nvidia/*/lib "
                        "nor on the loader path (pip install nvidia-cuda-nvrtc)")
    return lib


def _error_text(lib: ctypes.CDLL, status: int) -> str:
    name, text = ctypes.c_char_p(), ctypes.c_char_p()
    if lib.cuGetErrorName(status, ctypes.byref(name)) != 0 or not name.value:
        return f"CUresult {status}"
    lib.cuGetErrorString(status, ctypes.byref(text))
    return f"{name.value.decode()} ({(text.value or b'').decode()})"


def _check(status: int, call: str) -> None:
    if status != 0:
        raise CudaError(f"{call} failed: {_error_text(_driver(), status)}")


def _nvrtc_check(status: int, call: str, log: str = "") -> None:
    if status != 0:
        err = _nvrtc().nvrtcGetErrorString(status)
        msg = f"{call} failed: {(err or b'').decode() or f'nvrtcResult {status}'}"
        raise CudaError(f"{msg}\n{log}" if log else msg)


# ---------------------------------------------------------------------------------------------
# compiling


def _arch_number(arch: str) -> str:
    """'sm_90a' -> '90a'; a ValueError for anything that is not a real architecture."""
    m = re.fullmatch(r"sm_(\d+[a-z]?)", arch)
    if m is None:
        raise ValueError(f"arch={arch!r}: want a real architecture such as 'sm_90a' (a cubin, not PTX)")
    return m.group(1)


def _options(options: Sequence[str]) -> tuple[str, ...]:
    if isinstance(options, str) or not all(isinstance(o, str) for o in options):
        raise TypeError(f"options={options!r}: want a sequence of strings, e.g. ['-lineinfo']")
    return tuple(options)


def _cache_dir() -> str:
    root = os.environ.get("TANDEM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tandem")
    return os.path.join(root, "cubin")


_CUBINS: dict[str, bytes] = {}  # sha256 of the key parts -> cubin


def _cache_key(key_parts: Sequence) -> str:
    return hashlib.sha256(json.dumps(list(key_parts)).encode()).hexdigest()


def _read_cubin(path: str) -> bytes | None:
    """The cached cubin, or None where there is none or it is unreadable or not an ELF file."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data if data.startswith(_ELF_MAGIC) else None


def _write_cubin(path: str, data: bytes) -> None:
    """Write through a temporary file in the same folder and rename it into place, so a reader
    never sees a partial `<sha>.cubin`. A cache that cannot be written is skipped."""
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=".part")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _cached(key_parts: Sequence, compile_fn) -> bytes:
    """`compile_fn()`'s cubin, from this process's cache, else the disk cache, else compiled now
    (and stored in both)."""
    key = _cache_key(key_parts)
    data = _CUBINS.get(key)
    if data is not None:
        return data
    path = os.path.join(_cache_dir(), f"{key}.cubin")
    data = _read_cubin(path)
    if data is None:
        data = compile_fn()
        _write_cubin(path, data)
    _CUBINS[key] = data
    return data


def _nvrtc_compile(source: str, arch: str, options: tuple[str, ...]) -> bytes:
    lib = _require_nvrtc()
    prog = _VP()
    _nvrtc_check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"tandem_kernel.cu", 0,
                                        None, None), "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}", "-std=c++17", "-default-device", *options]
        argv = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        status = lib.nvrtcCompileProgram(prog, len(opts), argv)
        if status != 0:
            _nvrtc_check(status, f"nvrtcCompileProgram ({' '.join(opts)})", _program_log(lib, prog))
        size = ctypes.c_size_t()
        _nvrtc_check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        buf = ctypes.create_string_buffer(size.value)
        _nvrtc_check(lib.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN")
        return buf.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _program_log(lib: ctypes.CDLL, prog: _VP) -> str:
    size = ctypes.c_size_t()
    if lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)) != 0 or size.value <= 1:
        return ""
    buf = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, buf)
    return buf.value.decode(errors="replace")


def compile_cubin(source: str, arch: str = "sm_90a", options: Sequence[str] = ()) -> bytes:
    """`source` compiled by NVRTC into a cubin for `arch` (with -std=c++17 -default-device and
    `options`). A compile error raises CudaError with NVRTC's log."""
    _arch_number(arch)
    options = _options(options)
    _require_nvrtc()
    key = ("nvrtc", source, arch, list(options), list(nvrtc_version()))
    return _cached(key, lambda: _nvrtc_compile(source, arch, options))


def _nvcc_path() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            return os.path.join(root, "bin", "nvcc")
    return None


def nvcc_available() -> bool:
    return _nvcc_path() is not None


def _tool(name: str) -> str | None:
    """A CUDA binary tool: beside nvcc (or its real file), on PATH, under the CUDA install, or
    the copy Triton's wheel bundles."""
    dirs = []
    nvcc = _nvcc_path()
    if nvcc:
        dirs += [os.path.dirname(nvcc), os.path.dirname(os.path.realpath(nvcc))]
    dirs += [os.path.join(r, "bin") for r in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"))
             if r]
    dirs.append("/usr/local/cuda/bin")
    for d in dirs:
        if os.access(os.path.join(d, name), os.X_OK):
            return os.path.join(d, name)
    if shutil.which(name):
        return shutil.which(name)
    spec = importlib.util.find_spec("triton")
    if spec is not None and spec.origin:
        bundled = os.path.join(os.path.dirname(spec.origin), "backends", "nvidia", "bin", name)
        if os.access(bundled, os.X_OK):
            return bundled
    return None


def cuobjdump_available() -> bool:
    return _tool("cuobjdump") is not None


@functools.lru_cache(maxsize=64)
def _nvcc(source: str, arch: str, options: tuple[str, ...]) -> tuple[bytes, str]:
    """(cubin, ptxas's -v report) of `source` compiled by the nvcc binary."""
    nvcc = _nvcc_path()
    if nvcc is None:
        raise CudaError("nvcc not found: not on PATH nor at $CUDA_HOME/bin or /usr/local/cuda/bin")
    number = _arch_number(arch)
    with tempfile.TemporaryDirectory(prefix="tandem-nvcc-") as d:
        src, out = os.path.join(d, "kernel.cu"), os.path.join(d, "kernel.cubin")
        with open(src, "w") as f:
            f.write(source)
        cmd = [nvcc, "-cubin", "-std=c++17", f"-gencode=arch=compute_{number},code=sm_{number}",
               "-Xptxas", "-v", *options, "-o", out, src]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise CudaError(f"nvcc failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                            f"{proc.stderr}{proc.stdout}")
        with open(out, "rb") as f:
            return f.read(), proc.stderr + proc.stdout


def nvcc_cubin(source: str, arch: str = "sm_90a", options: Sequence[str] = ()) -> bytes:
    """`source` compiled by the nvcc binary into a cubin for `arch` (-std=c++17 and `options`):
    the check, on a machine without a GPU, that a kernel compiles for Hopper. CudaError with
    nvcc's output on failure."""
    return _nvcc(source, arch, _options(options))[0]


def ptxas_resource_usage(source: str, arch: str = "sm_90a", options: Sequence[str] = ()) -> str:
    """ptxas's `-v` report for `nvcc_cubin(source, arch, options)`: registers, spills, shared
    memory per kernel."""
    return _nvcc(source, arch, _options(options))[1]


def cuobjdump_sass(cubin: bytes) -> str:
    """The SASS of a cubin, as `cuobjdump --dump-sass` prints it."""
    tool = _tool("cuobjdump")
    if tool is None:
        raise CudaError("cuobjdump not found: not beside nvcc, on PATH, nor in Triton's wheel")
    with tempfile.TemporaryDirectory(prefix="tandem-sass-") as d:
        path = os.path.join(d, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        proc = subprocess.run([tool, "--dump-sass", path], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise CudaError(f"cuobjdump --dump-sass failed (exit {proc.returncode}):\n{proc.stderr}")
    return proc.stdout


# ---------------------------------------------------------------------------------------------
# TMA descriptors


class TensorMap:
    """A `CUtensorMap`: 128 opaque bytes at a 128-byte aligned address. As a kernel argument it
    passes by value (the kernel declares `const __grid_constant__ Map map` with a 64-byte aligned
    128-byte struct). It holds the tensor's address, not the tensor: keep the memory alive while
    a kernel may use the map. `device`: the tensor's device (checked at launch)."""

    def __init__(self, device: torch.device | None = None):
        self._buffer = (ctypes.c_ubyte * (_TMAP_BYTES + _TMAP_ALIGN - 1))()
        base = ctypes.addressof(self._buffer)
        self.address = (base + _TMAP_ALIGN - 1) // _TMAP_ALIGN * _TMAP_ALIGN
        self.device = device

    def bytes(self) -> bytes:
        return ctypes.string_at(self.address, _TMAP_BYTES)


def _check_tensor_map_args(t: torch.Tensor, box_rows: int, box_cols: int, swizzle_bytes: int) -> int:
    """The element size; a ValueError naming the argument for anything TMA cannot describe."""
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise ValueError(f"t: want a 2-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
    if t.dtype not in _TMAP_DTYPES:
        raise ValueError(f"t.dtype={t.dtype}: want one of {sorted(str(d) for d in _TMAP_DTYPES)}")
    elem = t.element_size()
    rows, cols = t.shape
    if rows == 0 or cols == 0 or rows > 2**32 or cols > 2**32:
        raise ValueError(f"t.shape={tuple(t.shape)}: each dim must be in 1..2**32")
    if t.stride(1) != 1:
        raise ValueError(f"t.stride()={t.stride()}: the last dim must be contiguous (stride 1)")
    if rows > 1 and (t.stride(0) < cols or t.stride(0) * elem % 16 or t.stride(0) * elem >= 2**40):
        raise ValueError(f"t.stride(0)={t.stride(0)} ({t.stride(0) * elem} bytes): the row stride "
                         "must be >= the row length, a multiple of 16 bytes and < 2**40 bytes")
    if t.data_ptr() % 16:
        raise ValueError(f"t.data_ptr()={t.data_ptr():#x}: the address must be 16-byte aligned")
    for name, box in (("box_rows", box_rows), ("box_cols", box_cols)):
        if not isinstance(box, int) or not 1 <= box <= 256:
            raise ValueError(f"{name}={box!r}: want an int in 1..256")
    if box_cols * elem % 16:
        raise ValueError(f"box_cols={box_cols}: a box row ({box_cols * elem} bytes) must be a multiple "
                         "of 16 bytes")
    if swizzle_bytes not in _TMAP_SWIZZLES:
        raise ValueError(f"swizzle_bytes={swizzle_bytes!r}: want 0 (none), 32, 64 or 128")
    if swizzle_bytes and box_cols * elem > swizzle_bytes:
        raise ValueError(f"box_cols={box_cols}: a box row ({box_cols * elem} bytes) must fit in "
                         f"swizzle_bytes={swizzle_bytes}; want box_cols <= {swizzle_bytes // elem}")
    return elem


def tensor_map_2d(t: torch.Tensor, box_rows: int, box_cols: int, swizzle_bytes: int = 128) -> TensorMap:
    """A TMA descriptor for tiles of `box_rows` x `box_cols` elements of the 2-D tensor `t`
    (row-major, last dim contiguous). A load at (col, row) fills shared memory with the box row
    by row (swizzled in 16-byte chunks within `swizzle_bytes` when nonzero); elements past the
    tensor's end read as zero. The caller caches the map (bound to `t`'s address and shape) and
    keeps `t`'s memory alive while kernels use it."""
    elem = _check_tensor_map_args(t, box_rows, box_cols, swizzle_bytes)
    lib = _require_driver()
    if not t.is_cuda:
        raise ValueError(f"t.device={t.device}: want a CUDA tensor")
    rows, cols = t.shape
    stride = t.stride(0) * elem if rows > 1 else -(-cols * elem // 16) * 16
    tmap = TensorMap(t.device)
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(stride)
    box = (ctypes.c_uint32 * 2)(box_cols, box_rows)
    steps = (ctypes.c_uint32 * 2)(1, 1)
    pushed = _make_current(t.device.index)
    try:
        _check(lib.cuTensorMapEncodeTiled(
            tmap.address, _TMAP_DTYPES[t.dtype], 2, t.data_ptr(), dims, strides, box, steps,
            _TMAP_INTERLEAVE_NONE, _TMAP_SWIZZLES[swizzle_bytes], _TMAP_L2_PROMOTION_256B,
            _TMAP_OOB_FILL_NONE),
            f"cuTensorMapEncodeTiled(shape={tuple(t.shape)}, stride={t.stride()}, "
            f"box=({box_rows}, {box_cols}), swizzle_bytes={swizzle_bytes})")
    finally:
        _pop(pushed)
    return tmap


# ---------------------------------------------------------------------------------------------
# contexts and launches


def _device_index(device) -> int:
    if device is None:
        return torch.cuda.current_device()
    d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if d.type != "cuda":
        raise ValueError(f"device={device!r}: want a CUDA device")
    return d.index if d.index is not None else torch.cuda.current_device()


@functools.cache
def _primary_context(index: int) -> int:
    """The device's primary context (the one torch's runtime uses), retained for the process."""
    lib = _require_driver()
    _check(lib.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    _check(lib.cuDeviceGet(ctypes.byref(dev), index), f"cuDeviceGet({index})")
    ctx = _VP()
    _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), f"cuDevicePrimaryCtxRetain({index})")
    return ctx.value


def _make_current(index: int) -> bool:
    """Make device `index`'s primary context current; True where another was current and this
    one was pushed over it (then `_pop` restores it)."""
    lib = _driver()
    want = _primary_context(index)
    cur = _VP()
    _check(lib.cuCtxGetCurrent(ctypes.byref(cur)), "cuCtxGetCurrent")
    if cur.value == want:
        return False
    if cur.value is None:
        _check(lib.cuCtxSetCurrent(want), "cuCtxSetCurrent")
        return False
    _check(lib.cuCtxPushCurrent_v2(want), "cuCtxPushCurrent")
    return True


def _pop(pushed: bool) -> None:
    if pushed:
        _check(_driver().cuCtxPopCurrent_v2(ctypes.byref(_VP())), "cuCtxPopCurrent")


def _dims(name: str, value) -> tuple[int, int, int]:
    if (not isinstance(value, (tuple, list)) or len(value) != 3
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)):
        raise ValueError(f"{name}={value!r}: want three positive ints (x, y, z)")
    return tuple(value)


def _check_args(args: Sequence) -> None:
    for i, a in enumerate(args):
        if isinstance(a, (torch.Tensor, TensorMap, ctypes._SimpleCData, ctypes.Structure)):
            continue
        if isinstance(a, (bool, int, float)):
            raise TypeError(f"args[{i}]={a!r}: wrap a Python number in the ctypes type of the kernel's "
                            "parameter (ctypes.c_int32, c_uint32, c_int64, c_float, ...) so its width "
                            "is explicit")
        raise TypeError(f"args[{i}]: a {type(a).__name__}; want a torch.Tensor (passed as its data "
                        "pointer), a TensorMap, or a ctypes scalar")


_MODULES: dict[tuple[str, int], int] = {}  # (sha256 of the cubin, device) -> CUmodule, never unloaded


class Kernel:
    """The `extern "C"` kernel `name` of a cubin, loaded into each device's primary context on
    first use (load it before a CUDA graph capture: `load()` or one launch). Modules stay loaded
    for the process, so graphs that captured a launch stay valid."""

    def __init__(self, cubin: bytes, name: str):
        if not isinstance(cubin, (bytes, bytearray)) or not bytes(cubin).startswith(_ELF_MAGIC):
            raise ValueError("cubin: want the bytes of a cubin (an ELF file), e.g. from compile_cubin")
        if not isinstance(name, str) or not name:
            raise ValueError(f"name={name!r}: want the kernel's extern \"C\" name")
        self.cubin = bytes(cubin)
        self.name = name
        self._sha = hashlib.sha256(self.cubin).hexdigest()
        self._functions: dict[int, int] = {}
        self._smem_max: dict[int, int] = {}  # device -> the dynamic shared memory the function may use
        self._non_portable: set[int] = set()

    def load(self, device=None) -> int:
        """The CUfunction on `device` (default: torch's current device), loading it if needed."""
        index = _device_index(device)
        fn = self._functions.get(index)
        if fn is None:
            lib = _require_driver()
            pushed = _make_current(index)
            try:
                fn = self._load(lib, index)
            finally:
                _pop(pushed)
            self._functions[index] = fn
        return fn

    def _load(self, lib: ctypes.CDLL, index: int) -> int:
        module = _MODULES.get((self._sha, index))
        if module is None:
            handle = _VP()
            _check(lib.cuModuleLoadData(ctypes.byref(handle), self.cubin),
                   f"cuModuleLoadData({self.name!r}'s cubin) on cuda:{index}")
            module = _MODULES[(self._sha, index)] = handle.value
        fn = _VP()
        status = lib.cuModuleGetFunction(ctypes.byref(fn), module, self.name.encode())
        if status != 0:
            raise CudaError(f"cuModuleGetFunction({self.name!r}) failed: {_error_text(lib, status)}; "
                            "is the kernel declared extern \"C\" __global__ with that name?")
        return fn.value

    def launch(self, grid: tuple[int, int, int], block: tuple[int, int, int], args: Sequence,
               shared_mem: int = 0, stream: int | None = None, cluster: tuple[int, int, int] = (1, 1, 1),
               device=None, pdl: bool = False) -> None:
        """Launch on `stream` (default: torch's current stream on the device, so a launch during a
        CUDA graph capture is captured). `args` in the kernel's parameter order: tensors (their
        data pointers), TensorMaps (by value), ctypes scalars. `cluster`: blocks per cluster (the
        grid a multiple of it). `pdl`: programmatic dependent launch (the kernel may start before
        the previous one on the stream ends; it must run `griddepcontrol.wait` first)."""
        grid, block, cluster = _dims("grid", grid), _dims("block", block), _dims("cluster", cluster)
        if any(g % c for g, c in zip(grid, cluster)):
            raise ValueError(f"grid={grid} is not a multiple of cluster={cluster} in every dim")
        if not isinstance(shared_mem, int) or shared_mem < 0:
            raise ValueError(f"shared_mem={shared_mem!r}: want a byte count >= 0")
        _check_args(args)
        lib = _require_driver()
        index = _device_index(device)
        for i, a in enumerate(args):
            where = a.device if isinstance(a, (torch.Tensor, TensorMap)) else None
            if where is not None and (where.type != "cuda" or where.index != index):
                raise ValueError(f"args[{i}] is on {where}, the launch on cuda:{index}: pass device= "
                                 "or move the tensor")
        if stream is None:
            stream = torch.cuda.current_stream(index).cuda_stream
        pushed = _make_current(index)
        try:
            fn = self._functions.get(index) or self.load(index)
            self._prepare(lib, fn, index, shared_mem, cluster)
            self._launch(lib, fn, grid, block, args, shared_mem, stream, cluster, pdl)
        finally:
            _pop(pushed)

    def _prepare(self, lib, fn: int, index: int, shared_mem: int, cluster: tuple) -> None:
        """The function attributes a launch needs: its dynamic shared memory (by default a kernel
        gets 48 KiB less its static shared memory; raised, never lowered, on the first launch that
        asks for more), a cluster larger than the portable 8 blocks."""
        if shared_mem > self._smem_max.get(index, 0):
            _check(lib.cuFuncSetAttribute(fn, _FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_mem),
                   f"cuFuncSetAttribute({self.name!r}, MAX_DYNAMIC_SHARED_SIZE_BYTES, {shared_mem})")
            self._smem_max[index] = shared_mem
        if cluster[0] * cluster[1] * cluster[2] > _PORTABLE_CLUSTER and index not in self._non_portable:
            _check(lib.cuFuncSetAttribute(fn, _FUNC_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
                   f"cuFuncSetAttribute({self.name!r}, NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)")
            self._non_portable.add(index)

    def _launch(self, lib, fn: int, grid, block, args, shared_mem, stream, cluster, pdl) -> None:
        values = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else a for a in args]
        params = (_VP * max(len(values), 1))(
            *[v.address if isinstance(v, TensorMap) else ctypes.addressof(v) for v in values])
        attrs = (_LaunchAttr * 2)()
        n = 0
        if cluster != (1, 1, 1):
            attrs[n].id = _LAUNCH_ATTR_CLUSTER_DIMENSION
            attrs[n].value.cluster_dim = _ClusterDim(*cluster)
            n += 1
        if pdl:
            attrs[n].id = _LAUNCH_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION
            attrs[n].value.flag = 1
            n += 1
        config = _LaunchConfig(*grid, *block, shared_mem, stream, attrs, n)
        _check(lib.cuLaunchKernelEx(ctypes.byref(config), fn, params, None),
               f"cuLaunchKernelEx({self.name!r}, grid={grid}, block={block}, cluster={cluster}, "
               f"shared_mem={shared_mem}, pdl={pdl})")
