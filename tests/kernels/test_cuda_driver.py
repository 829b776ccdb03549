"""Run-time compiled CUDA C++ kernels (`tandem.kernels.cuda_driver`).

On any machine: the argument checks (before any driver call), the cubin cache, the ctypes
layouts against `cuda.h` (where gcc and the header are installed), and, where the `nvcc` binary
is, that a header-free TMA kernel compiles for Hopper into SASS with a TMA load. Where NVRTC is
found, the same through NVRTC. On a GPU (sm_90+): launches with tensors and ctypes scalars,
clusters, TMA tiles (plain and 128-byte swizzled, past the tensor's end), large dynamic shared
memory, programmatic dependent launch and a CUDA graph replay.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import pytest
import torch

from tandem.kernels import cuda_driver as cd

ELF = b"\x7fELF"

# 128-byte opaque CUtensorMap as the kernel sees it; a helper every kernel below may use
PRELUDE = r"""
struct alignas(64) TmaMap { unsigned long long opaque[16]; };

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned a;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
"""

# One 64 x 64 bf16 tile per block, loaded by TMA at (col, row) = 64 * (blockIdx.x, blockIdx.y) and
# written back row-major to `out` ([gridDim.y * 64, out_cols]); `swizzled`: the map uses the
# 128-byte swizzle (16-byte chunk j of row r lands at chunk j ^ (r % 8); the tile 1024-aligned).
TMA_SOURCE = PRELUDE + r"""
extern "C" __global__ void tma_tile_copy(const __grid_constant__ TmaMap tmap, unsigned short* out,
                                         int out_cols, int swizzled) {
    __shared__ alignas(1024) unsigned short tile[64 * 64];
    __shared__ alignas(8) unsigned long long bar;
    const unsigned bar_addr = smem_u32(&bar);
    const int col0 = blockIdx.x * 64, row0 = blockIdx.y * 64;
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar_addr) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("{ .reg .b64 state; mbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1; }"
                     :: "r"(bar_addr), "r"(64 * 64 * 2) : "memory");
        asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                     " [%0], [%1, {%2, %3}], [%4];"
                     :: "r"(smem_u32(tile)), "l"(reinterpret_cast<unsigned long long>(&tmap)),
                        "r"(col0), "r"(row0), "r"(bar_addr) : "memory");
    }
    unsigned done = 0;
    while (!done) {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;"
                     " selp.u32 %0, 1, 0, p; }" : "=r"(done) : "r"(bar_addr), "r"(0) : "memory");
    }
    for (int i = threadIdx.x; i < 64 * 64; i += blockDim.x) {
        const int r = i / 64, c = i % 64;
        const int chunk = swizzled ? ((c / 8) ^ (r % 8)) : c / 8;
        out[(long long)(row0 + r) * out_cols + col0 + c] = tile[r * 64 + chunk * 8 + c % 8];
    }
}
"""

# Per block: its rank in the cluster, its cluster's index, the cluster size, and the block index
# its neighbour (rank ^ 1) wrote into its own shared memory, read through distributed shared memory.
CLUSTER_SOURCE = PRELUDE + r"""
extern "C" __global__ void cluster_ids(unsigned* out) {
    __shared__ unsigned mine;
    unsigned rank, cluster, size, peer, remote;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(cluster));
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(size));
    if (threadIdx.x == 0) mine = blockIdx.x;
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;"
                 ::: "memory");
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_u32(&mine)), "r"(rank ^ 1));
    asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(peer) : "r"(remote) : "memory");
    // no block leaves (and frees its shared memory) before its neighbour has read it
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;"
                 ::: "memory");
    if (threadIdx.x == 0) {
        out[4 * blockIdx.x + 0] = rank;
        out[4 * blockIdx.x + 1] = cluster;
        out[4 * blockIdx.x + 2] = size;
        out[4 * blockIdx.x + 3] = peer;
    }
}
"""

# scalars of three widths: a float, a 64-bit count
AXPY_SOURCE = r"""
extern "C" __global__ void axpy(const float* a, const float* b, float* c, float alpha, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) c[i] = a[i] + alpha * b[i];
}
"""

# all of `n` floats through dynamic shared memory (more than the 48 KiB default), reversed
SMEM_SOURCE = r"""
extern "C" __global__ void smem_reverse(const float* x, float* y, int n) {
    extern __shared__ float buf[];
    for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = x[i];
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) y[i] = buf[n - 1 - i];
}
"""

# a programmatic dependent launch: wait for the previous kernel's writes before reading
PDL_SOURCE = r"""
extern "C" __global__ void double_after_wait(const float* x, float* y, int n) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = 2.0f * x[i];
}
"""

needs_nvcc = pytest.mark.skipif(not cd.nvcc_available(), reason="needs the nvcc binary")
needs_nvrtc = pytest.mark.skipif(not cd.nvrtc_available(), reason="needs libnvrtc")
needs_cuobjdump = pytest.mark.skipif(not cd.cuobjdump_available(), reason="needs cuobjdump")
FAKE_CUBIN = ELF + bytes(60)


# --- CPU: the layouts, the compilers ---------------------------------------------------------


def _cuda_header() -> str | None:
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for root in filter(None, roots):
        if os.path.exists(os.path.join(root, "include", "cuda.h")):
            return os.path.join(root, "include")
    return None


def test_ctypes_layouts_and_enum_values_match_cuda_h(tmp_path):
    """Every struct offset and enum value the module hands the driver, against the installed
    cuda.h compiled by gcc."""
    include = _cuda_header()
    if include is None or shutil.which("gcc") is None:
        pytest.skip("needs gcc and cuda.h")
    want = {
        "sizeof(CUlaunchAttribute)": ctypes.sizeof(cd._LaunchAttr),
        "offsetof(CUlaunchAttribute, value)": cd._LaunchAttr.value.offset,
        "sizeof(CUlaunchAttributeValue)": ctypes.sizeof(cd._LaunchAttrValue),
        "offsetof(CUlaunchAttributeValue, clusterDim.z)": cd._ClusterDim.z.offset,
        "offsetof(CUlaunchAttributeValue, programmaticStreamSerializationAllowed)": 0,
        "sizeof(CUlaunchConfig)": ctypes.sizeof(cd._LaunchConfig),
        "offsetof(CUlaunchConfig, sharedMemBytes)": cd._LaunchConfig.shared_mem_bytes.offset,
        "offsetof(CUlaunchConfig, hStream)": cd._LaunchConfig.stream.offset,
        "offsetof(CUlaunchConfig, attrs)": cd._LaunchConfig.attrs.offset,
        "offsetof(CUlaunchConfig, numAttrs)": cd._LaunchConfig.num_attrs.offset,
        "sizeof(CUtensorMap)": cd._TMAP_BYTES,
        "_Alignof(CUtensorMap)": None,  # 64 in CUDA 12's header, 128 in 13's: ours a multiple
        "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES": cd._FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        "CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED": cd._FUNC_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
        "CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION": cd._LAUNCH_ATTR_CLUSTER_DIMENSION,
        "CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION":
            cd._LAUNCH_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION,
        "CU_TENSOR_MAP_DATA_TYPE_FLOAT16": cd._TMAP_DTYPES[torch.float16],
        "CU_TENSOR_MAP_DATA_TYPE_FLOAT32": cd._TMAP_DTYPES[torch.float32],
        "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16": cd._TMAP_DTYPES[torch.bfloat16],
        "CU_TENSOR_MAP_INTERLEAVE_NONE": cd._TMAP_INTERLEAVE_NONE,
        "CU_TENSOR_MAP_SWIZZLE_NONE": cd._TMAP_SWIZZLES[0],
        "CU_TENSOR_MAP_SWIZZLE_32B": cd._TMAP_SWIZZLES[32],
        "CU_TENSOR_MAP_SWIZZLE_64B": cd._TMAP_SWIZZLES[64],
        "CU_TENSOR_MAP_SWIZZLE_128B": cd._TMAP_SWIZZLES[128],
        "CU_TENSOR_MAP_L2_PROMOTION_L2_256B": cd._TMAP_L2_PROMOTION_256B,
        "CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE": cd._TMAP_OOB_FILL_NONE,
    }
    lines = "\n".join(f'    printf("%lld\\n", (long long)({expr}));' for expr in want)
    src = tmp_path / "layout.c"
    src.write_text(f"#include <cuda.h>\n#include <stddef.h>\n#include <stdio.h>\nint main(void) {{\n{lines}\n"
                   "    return 0;\n}\n")
    exe = tmp_path / "layout"
    subprocess.run(["gcc", "-std=c11", "-I", include, str(src), "-o", str(exe)], check=True,
                   capture_output=True)
    got = [int(v) for v in subprocess.run([str(exe)], check=True, capture_output=True,
                                          text=True).stdout.split()]
    got = dict(zip(want, got))
    assert cd._TMAP_ALIGN % got.pop("_Alignof(CUtensorMap)") == 0
    assert got == {k: v for k, v in want.items() if v is not None}


@needs_nvcc
def test_nvcc_compiles_the_tma_kernel_for_hopper():
    cubin = cd.nvcc_cubin(TMA_SOURCE)
    assert cubin.startswith(ELF)
    usage = cd.ptxas_resource_usage(TMA_SOURCE)
    assert "tma_tile_copy" in usage and "registers" in usage and "sm_90a" in usage
    if cd.cuobjdump_available():
        sass = cd.cuobjdump_sass(cubin)
        assert "UTMALDG.2D" in sass  # the TMA load
        assert "SYNCS.PHASECHK" in sass  # the mbarrier wait


@needs_nvcc
def test_nvcc_compiles_the_cluster_and_pdl_kernels():
    for source in (CLUSTER_SOURCE, PDL_SOURCE, AXPY_SOURCE, SMEM_SOURCE):
        assert cd.nvcc_cubin(source).startswith(ELF)


@needs_nvcc
def test_nvcc_error_carries_its_message():
    with pytest.raises(cd.CudaError, match="nvcc failed") as e:
        cd.nvcc_cubin('extern "C" __global__ void broken(int* x) { x[0] = undeclared_name; }')
    assert "undeclared_name" in str(e.value)


def test_arch_and_options_checked_before_compiling():
    with pytest.raises(ValueError, match="arch='compute_90a'"):
        cd.compile_cubin("", arch="compute_90a")
    with pytest.raises(ValueError, match="arch='90'"):
        cd.nvcc_cubin("", arch="90")
    with pytest.raises(TypeError, match="options="):
        cd.compile_cubin("", options="-lineinfo")


@needs_nvrtc
def test_nvrtc_compiles_the_tma_kernel_and_caches_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    monkeypatch.setattr(cd, "_CUBINS", {})
    cubin = cd.compile_cubin(TMA_SOURCE)
    assert cubin.startswith(ELF)
    [cached] = os.listdir(tmp_path / "cubin")
    assert cached.endswith(".cubin") and (tmp_path / "cubin" / cached).read_bytes() == cubin
    cd._CUBINS.clear()
    with monkeypatch.context() as m:
        m.setattr(cd, "_nvrtc_compile", None)  # not called: the disk has it
        assert cd.compile_cubin(TMA_SOURCE) == cubin
    assert cd.compile_cubin(TMA_SOURCE, options=["-lineinfo"]).startswith(ELF)
    assert len(os.listdir(tmp_path / "cubin")) == 2
    if cd.cuobjdump_available():
        assert "UTMALDG.2D" in cd.cuobjdump_sass(cubin)


@needs_nvrtc
def test_nvrtc_error_carries_the_program_log(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    with pytest.raises(cd.CudaError, match="nvrtcCompileProgram") as e:
        cd.compile_cubin('extern "C" __global__ void broken(int* x) { x[0] = undeclared_name; }')
    assert "undeclared_name" in str(e.value) and "error" in str(e.value)


# --- CPU: the cubin cache ----------------------------------------------------------------------


class Compiler:
    def __init__(self, data: bytes = ELF + b"cubin"):
        self.data, self.calls = data, 0

    def __call__(self) -> bytes:
        self.calls += 1
        return self.data


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    monkeypatch.setattr(cd, "_CUBINS", {})
    return tmp_path / "cubin"


KEY = ("nvrtc", "source", "sm_90a", [], [13, 0])


def test_cache_memory_then_disk(cache):
    compile_fn = Compiler()
    assert cd._cached(KEY, compile_fn) == compile_fn.data and compile_fn.calls == 1
    path = cache / f"{cd._cache_key(KEY)}.cubin"
    assert os.listdir(cache) == [path.name] and path.read_bytes() == compile_fn.data  # no temp left
    path.unlink()
    assert cd._cached(KEY, compile_fn) == compile_fn.data and compile_fn.calls == 1  # this process's
    cd._CUBINS.clear()
    path.write_bytes(ELF + b"from disk")
    assert cd._cached(KEY, compile_fn) == ELF + b"from disk" and compile_fn.calls == 1  # the disk's
    # every part of the key counts
    for other in (("nvrtc", "source", "sm_90a", ["-lineinfo"], [13, 0]),
                  ("nvrtc", "source", "sm_90a", [], [13, 1]), ("nvrtc", "source2", "sm_90a", [], [13, 0])):
        assert cd._cache_key(other) != cd._cache_key(KEY)


def test_cache_ignores_partial_and_corrupt_files(cache):
    compile_fn = Compiler()
    path = cache / f"{cd._cache_key(KEY)}.cubin"
    cache.mkdir(parents=True)
    # what a writer killed mid-write leaves: only its temporary file, never read
    (cache / ".tmp-abc123.part").write_bytes(ELF + b"half")
    (cache / f"{path.name}.part").write_bytes(ELF + b"half")
    assert cd._cached(KEY, compile_fn) == compile_fn.data and compile_fn.calls == 1
    # a final file that is not a cubin (truncated, overwritten) is compiled again and replaced
    path.write_bytes(ELF[:3])
    cd._CUBINS.clear()
    assert cd._cached(KEY, compile_fn) == compile_fn.data and compile_fn.calls == 2
    assert path.read_bytes() == compile_fn.data


def test_cache_write_failures_leave_no_file(cache, monkeypatch):
    compile_fn = Compiler()
    path = cache / f"{cd._cache_key(KEY)}.cubin"

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(cd.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cd._cached(KEY, compile_fn)
    assert os.listdir(cache) == []  # the temporary file removed, no <sha>.cubin

    def failed(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(cd.os, "replace", failed)
    assert cd._cached(KEY, compile_fn) == compile_fn.data  # the cache is skipped, not fatal
    assert os.listdir(cache) == [] and not path.exists()


def test_cache_in_an_unwritable_place_still_compiles(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("TANDEM_CACHE", str(blocker))
    monkeypatch.setattr(cd, "_CUBINS", {})
    compile_fn = Compiler()
    assert cd._cached(KEY, compile_fn) == compile_fn.data


def test_cache_folder_defaults_to_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("TANDEM_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cd._cache_dir() == str(tmp_path / "tandem" / "cubin")
    monkeypatch.setenv("TANDEM_CACHE", "/somewhere")
    assert cd._cache_dir() == "/somewhere/cubin"


# --- CPU: argument checks before any driver call ------------------------------------------------


def _bf16(rows=128, cols=64):
    return torch.zeros(rows, cols, dtype=torch.bfloat16)


@pytest.mark.parametrize("make,kwargs,field", [
    (lambda: _bf16().t(), {}, r"t\.stride\(\)"),  # last dim not contiguous
    (lambda: torch.zeros(128, 60, dtype=torch.bfloat16), {"box_cols": 32}, r"t\.stride\(0\)"),  # 120 B
    (lambda: torch.zeros(4, 8, 8, dtype=torch.bfloat16), {}, "2-D"),
    (lambda: torch.zeros(64, 64, dtype=torch.int32), {}, r"t\.dtype"),
    (lambda: _bf16(), {"box_cols": 128}, "box_cols=128.*swizzle_bytes=128"),  # 256 B > 128 B
    (lambda: _bf16(), {"box_cols": 64, "swizzle_bytes": 64}, "box_cols=64.*swizzle_bytes=64"),
    (lambda: _bf16(), {"swizzle_bytes": 16}, "swizzle_bytes=16"),
    (lambda: _bf16(), {"box_rows": 0}, "box_rows=0"),
    (lambda: _bf16(), {"box_rows": 257}, "box_rows=257"),
    (lambda: _bf16(), {"box_cols": 4, "swizzle_bytes": 0}, "box_cols=4"),  # 8 B: not a multiple of 16
    (lambda: torch.zeros(8256, dtype=torch.bfloat16)[1:8193].view(128, 64), {}, r"t\.data_ptr\(\)"),
    (lambda: torch.zeros(0, 64, dtype=torch.bfloat16), {}, r"t\.shape"),
])
def test_tensor_map_checks_name_the_field(make, kwargs, field):
    args = {"box_rows": 64, "box_cols": 64, "swizzle_bytes": 128, **kwargs}
    with pytest.raises(ValueError, match=field):
        cd.tensor_map_2d(make(), **args)


@pytest.mark.parametrize("t,box_rows,box_cols,swizzle", [
    (torch.zeros(100, 80, dtype=torch.bfloat16)[:, :72], 64, 64, 128),  # a 160-byte row stride
    (torch.zeros(16, 36, dtype=torch.float32), 8, 32, 128),  # 144 bytes a row
    (torch.zeros(1, 7, dtype=torch.float16), 1, 8, 0),  # one row: its stride unused
    (torch.zeros(300, 256, dtype=torch.float16), 256, 256, 0),
])
def test_tensor_map_checks_pass_what_tma_can_describe(t, box_rows, box_cols, swizzle):
    assert cd._check_tensor_map_args(t, box_rows, box_cols, swizzle) == t.element_size()


@pytest.mark.skipif(cd.driver_available(), reason="checks the message without a driver")
def test_tensor_map_without_a_driver():
    with pytest.raises(cd.CudaError, match="no CUDA driver"):
        cd.tensor_map_2d(_bf16(), 64, 64)


def test_tensor_map_buffer_is_aligned():
    tmaps = [cd.TensorMap() for _ in range(8)]
    assert all(m.address % 128 == 0 and m.bytes() == bytes(128) for m in tmaps)


def test_kernel_launch_checks_arguments_first():
    k = cd.Kernel(FAKE_CUBIN, "k")
    with pytest.raises(TypeError, match=r"args\[1\]=5: wrap .* ctypes"):
        k.launch((1, 1, 1), (32, 1, 1), [ctypes.c_int32(1), 5])
    with pytest.raises(TypeError, match=r"args\[0\]=2\.0"):
        k.launch((1, 1, 1), (32, 1, 1), [2.0])
    with pytest.raises(TypeError, match=r"args\[0\]: a str"):
        k.launch((1, 1, 1), (32, 1, 1), ["x"])
    with pytest.raises(ValueError, match=r"grid=\(3, 2, 1\) is not a multiple of cluster=\(2, 1, 1\)"):
        k.launch((3, 2, 1), (32, 1, 1), [], cluster=(2, 1, 1))
    with pytest.raises(ValueError, match="block="):
        k.launch((1, 1, 1), (0, 1, 1), [])
    with pytest.raises(ValueError, match="grid="):
        k.launch((1, 1), (1, 1, 1), [])
    with pytest.raises(ValueError, match="shared_mem="):
        k.launch((1, 1, 1), (1, 1, 1), [], shared_mem=-1)
    with pytest.raises(ValueError, match="cubin"):
        cd.Kernel(b"not a cubin", "k")


@pytest.mark.skipif(cd.driver_available(), reason="checks the message without a driver")
def test_kernel_launch_without_a_driver():
    with pytest.raises(cd.CudaError, match="no CUDA driver"):
        cd.Kernel(FAKE_CUBIN, "k").launch((1, 1, 1), (32, 1, 1), [ctypes.c_int32(1)])


# --- CPU: a launch against a stand-in driver -----------------------------------------------------


class FakeDriver:
    """Records what `Kernel` hands the driver: contexts, module loads, attributes, launches."""

    PRIMARY = 0x1000

    def __init__(self, current=None):
        self.current, self.stack, self.calls, self.launches = current, [], [], []

    def cuInit(self, flags):
        return 0

    def cuDeviceGet(self, ref, index):
        ref._obj.value = index
        return 0

    def cuDevicePrimaryCtxRetain(self, ref, dev):
        ref._obj.value = self.PRIMARY + getattr(dev, "value", dev)
        return 0

    def cuCtxGetCurrent(self, ref):
        ref._obj.value = self.current
        return 0

    def cuCtxSetCurrent(self, ctx):
        self.calls.append(("set", ctx))
        self.current = ctx
        return 0

    def cuCtxPushCurrent_v2(self, ctx):
        self.calls.append(("push", ctx))
        self.stack.append(self.current)
        self.current = ctx
        return 0

    def cuCtxPopCurrent_v2(self, ref):
        self.calls.append(("pop",))
        self.current = self.stack.pop()
        return 0

    def cuModuleLoadData(self, ref, image):
        self.calls.append(("load", self.current))
        ref._obj.value = 0x2000
        return 0

    def cuModuleGetFunction(self, ref, module, name):
        if name != b"k":
            return 500  # CUDA_ERROR_NOT_FOUND
        ref._obj.value = 0x3000
        return 0

    def cuFuncSetAttribute(self, fn, attr, value):
        self.calls.append(("attr", attr, value))
        return 0

    def cuGetErrorName(self, status, ref):
        ref._obj.value = b"CUDA_ERROR_NOT_FOUND"
        return 0

    def cuGetErrorString(self, status, ref):
        ref._obj.value = b"named symbol not found"
        return 0

    def cuLaunchKernelEx(self, config_ref, fn, params, extra):
        c = config_ref._obj
        attrs = [(c.attrs[i].id, tuple(c.attrs[i].value.cluster_dim.__getattribute__(f) for f in "xyz"),
                  c.attrs[i].value.flag) for i in range(c.num_attrs)]
        self.launches.append({
            "grid": (c.grid_x, c.grid_y, c.grid_z), "block": (c.block_x, c.block_y, c.block_z),
            "smem": c.shared_mem_bytes, "stream": c.stream, "attrs": attrs, "params": list(params),
            "values": [ctypes.string_at(q, 8) for q in params],  # what the driver copies now
            "context": self.current})
        return 0


@pytest.fixture
def fake_driver(monkeypatch):
    driver = FakeDriver()
    monkeypatch.setattr(cd, "_driver", lambda: driver)
    monkeypatch.setattr(cd, "_MODULES", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    stream = type("Stream", (), {"cuda_stream": 0xABC})
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    cd._primary_context.cache_clear()
    yield driver
    cd._primary_context.cache_clear()


def test_launch_hands_the_driver_its_arguments(fake_driver):
    k = cd.Kernel(FAKE_CUBIN, "k")
    tmap = cd.TensorMap()
    ctypes.memmove(tmap.address, bytes(range(128)), 128)
    k.launch((4, 2, 1), (128, 1, 1), [tmap, ctypes.c_int32(-7), ctypes.c_float(0.5), ctypes.c_uint64(2**40)])
    [launch] = fake_driver.launches
    assert launch["grid"] == (4, 2, 1) and launch["block"] == (128, 1, 1) and launch["smem"] == 0
    assert launch["stream"] == 0xabc and launch["attrs"] == []
    # no context was current: the device's primary one made current (not pushed), then loaded into
    assert fake_driver.calls[:2] == [("set", FakeDriver.PRIMARY), ("load", FakeDriver.PRIMARY)]
    p = launch["params"]
    assert p[0] == tmap.address and ctypes.string_at(p[0], 128) == bytes(range(128))  # by value
    v = launch["values"]
    assert ctypes.c_int32.from_buffer_copy(v[1][:4]).value == -7
    assert ctypes.c_float.from_buffer_copy(v[2][:4]).value == 0.5
    assert ctypes.c_uint64.from_buffer_copy(v[3]).value == 2**40


def test_launch_attributes(fake_driver):
    k = cd.Kernel(FAKE_CUBIN, "k")
    k.launch((4, 1, 1), (32, 1, 1), [], cluster=(2, 1, 1), pdl=True, stream=0x55)
    launch = fake_driver.launches[-1]
    assert launch["stream"] == 0x55
    assert launch["attrs"] == [(cd._LAUNCH_ATTR_CLUSTER_DIMENSION, (2, 1, 1), 2),
                               (cd._LAUNCH_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION, (1, 0, 0), 1)]
    attrs = [c for c in fake_driver.calls if c[0] == "attr"]
    assert attrs == []
    # a cluster past 8 blocks: the non-portable attribute, once
    for _ in range(2):
        k.launch((32, 1, 1), (32, 1, 1), [], cluster=(16, 1, 1))
    # dynamic shared memory: raised when a launch asks for more than before, never lowered
    for size in (100 << 10, 60 << 10, 100 << 10, 150 << 10):
        k.launch((1, 1, 1), (32, 1, 1), [], shared_mem=size)
        assert fake_driver.launches[-1]["smem"] == size
    attrs = [c for c in fake_driver.calls if c[0] == "attr"]
    assert attrs == [("attr", cd._FUNC_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
                     ("attr", cd._FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES, 100 << 10),
                     ("attr", cd._FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES, 150 << 10)]
    assert [c for c in fake_driver.calls if c[0] == "load"] == [("load", FakeDriver.PRIMARY)]  # once


def test_launch_under_another_context_pushes_and_pops(fake_driver):
    fake_driver.current = 0x9999  # someone else's context
    cd.Kernel(FAKE_CUBIN, "k").launch((1, 1, 1), (32, 1, 1), [])
    assert fake_driver.launches[-1]["context"] == FakeDriver.PRIMARY
    assert fake_driver.current == 0x9999 and fake_driver.stack == []


def test_launch_checks_the_devices_of_tensors_and_maps(fake_driver):
    k = cd.Kernel(FAKE_CUBIN, "k")
    with pytest.raises(ValueError, match=r"args\[1\] is on cpu, the launch on cuda:0"):
        k.launch((1, 1, 1), (32, 1, 1), [ctypes.c_int32(1), torch.zeros(4)])
    with pytest.raises(ValueError, match=r"args\[0\] is on cuda:1, the launch on cuda:0"):
        k.launch((1, 1, 1), (32, 1, 1), [cd.TensorMap(torch.device("cuda", 1))])
    assert fake_driver.launches == []


def test_a_missing_kernel_name_is_named(fake_driver):
    with pytest.raises(cd.CudaError, match=r"cuModuleGetFunction\('nope'\).*CUDA_ERROR_NOT_FOUND.*extern"):
        cd.Kernel(FAKE_CUBIN, "nope").launch((1, 1, 1), (32, 1, 1), [])


# --- GPU ----------------------------------------------------------------------------------------


def _arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}a" if major >= 9 else f"sm_{major}{minor}"


def _hopper():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs sm_90+ (clusters, TMA, griddepcontrol)")


@pytest.mark.gpu
def test_axpy_with_tensors_and_scalars():
    k = cd.Kernel(cd.compile_cubin(AXPY_SOURCE, _arch()), "axpy")
    n = 1000
    a, b = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    c = torch.empty(n, device="cuda")
    k.launch(((n + 127) // 128, 1, 1), (128, 1, 1), [a, b, c, ctypes.c_float(0.5), ctypes.c_int64(n)])
    torch.testing.assert_close(c, a + 0.5 * b)


@pytest.mark.gpu
def test_launch_errors_name_the_problem():
    cubin = cd.compile_cubin(AXPY_SOURCE, _arch())
    with pytest.raises(cd.CudaError, match="no_such_kernel"):
        cd.Kernel(cubin, "no_such_kernel").load()
    k = cd.Kernel(cubin, "axpy")
    cpu = torch.zeros(4)
    with pytest.raises(ValueError, match=r"args\[0\] is on cpu"):
        k.launch((1, 1, 1), (32, 1, 1), [cpu, cpu, cpu, ctypes.c_float(1.0), ctypes.c_int64(4)])


@pytest.mark.gpu
@pytest.mark.parametrize("cluster_x", [2, 16])  # 16: past the portable 8, the attribute set
def test_cluster_launch(cluster_x):
    _hopper()
    k = cd.Kernel(cd.compile_cubin(CLUSTER_SOURCE, _arch()), "cluster_ids")
    blocks = 32
    out = torch.full((blocks, 4), -1, dtype=torch.int32, device="cuda")
    k.launch((blocks, 1, 1), (64, 1, 1), [out], cluster=(cluster_x, 1, 1))
    b = torch.arange(blocks, dtype=torch.int32)
    want = torch.stack([b % cluster_x, b // cluster_x, torch.full_like(b, cluster_x), b ^ 1], dim=1)
    assert torch.equal(out.cpu(), want)


def _tiles(t: torch.Tensor, swizzle: int) -> torch.Tensor:
    k = cd.Kernel(cd.compile_cubin(TMA_SOURCE, _arch()), "tma_tile_copy")
    rows, cols = t.shape
    grid = (-(-cols // 64), -(-rows // 64), 1)
    out = torch.full((grid[1] * 64, grid[0] * 64), -1, dtype=torch.int16, device="cuda")
    tmap = cd.tensor_map_2d(t, 64, 64, swizzle_bytes=swizzle)
    assert tmap.address % 64 == 0 and len(tmap.bytes()) == 128 and tmap.bytes() != bytes(128)
    k.launch(grid, (128, 1, 1), [tmap, out, ctypes.c_int32(out.shape[1]), ctypes.c_int32(swizzle > 0)])
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("swizzle", [0, 128])
def test_tma_tiles_with_zeros_past_the_end(swizzle):
    """100 x 72 of a 100 x 80 bf16 tensor (a 160-byte row stride): four 64 x 64 tiles, three of
    them running past the rows, the columns or both, which read as zeros."""
    _hopper()
    full = torch.randn(100, 80, device="cuda").to(torch.bfloat16)
    t = full[:, :72]
    out = _tiles(t, swizzle)
    want = torch.zeros(128, 128, dtype=torch.int16, device="cuda")
    want[:100, :72] = t.view(torch.int16)
    assert torch.equal(out, want)


@pytest.mark.gpu
def test_large_dynamic_shared_memory():
    k = cd.Kernel(cd.compile_cubin(SMEM_SOURCE, _arch()), "smem_reverse")
    # past the 48 KiB a kernel gets without the attribute; a smaller size after a larger one
    for kib in (100, 60, 100, 8):
        n = kib * 1024 // 4
        x = torch.randn(n, device="cuda")
        y = torch.empty_like(x)
        k.launch((1, 1, 1), (256, 1, 1), [x, y, ctypes.c_int32(n)], shared_mem=n * 4)
        assert torch.equal(y, x.flip(0)), kib


@pytest.mark.gpu
def test_programmatic_dependent_launch():
    _hopper()
    k = cd.Kernel(cd.compile_cubin(PDL_SOURCE, _arch()), "double_after_wait")
    n = 1 << 20
    x = torch.empty(n, device="cuda")
    y = torch.empty(n, device="cuda")
    for value in (1.0, 3.0):
        x.fill_(value)  # the previous kernel on the stream
        k.launch((n // 256, 1, 1), (256, 1, 1), [x, y, ctypes.c_int32(n)], pdl=True)
        assert torch.equal(y, torch.full_like(x, 2 * value))


@pytest.mark.gpu
def test_launch_captured_by_a_cuda_graph():
    k = cd.Kernel(cd.compile_cubin(AXPY_SOURCE, _arch()), "axpy")
    n = 4096
    a, b = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    c = torch.zeros(n, device="cuda")
    args = [a, b, c, ctypes.c_float(2.0), ctypes.c_int64(n)]
    k.launch((n // 256, 1, 1), (256, 1, 1), args)  # loaded before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        k.launch((n // 256, 1, 1), (256, 1, 1), args)
    a.copy_(torch.randn(n, device="cuda"))
    c.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(c, a + 2.0 * b)
