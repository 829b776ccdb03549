"""Device memory whose physical pages can be released and mapped again at the same address.

Built on CUDA's virtual memory API (cuMemAddressReserve / cuMemCreate / cuMemMap) through
`cuda.bindings.driver`. Tensors viewing a `CuMemBuffer` keep their device address across
`unmap()` / `map()`, so CUDA graphs captured over them stay valid after a sleep.
"""

from __future__ import annotations

import time

import torch


def vmm_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return False
    return True


def _check(result):
    err, *rest = result if isinstance(result, tuple) else (result,)
    from cuda.bindings import driver as cu

    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return rest[0] if len(rest) == 1 else rest


class _ArrayInterface:
    """Lets torch view raw device memory without owning it."""

    def __init__(self, ptr: int, nbytes: int, device_index: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None,
        }
        self.device_index = device_index


class CuMemBuffer:
    """`nbytes` of device memory at a fixed virtual address; `unmap()` returns it to the driver."""

    def __init__(self, nbytes: int, device: torch.device):
        from cuda.bindings import driver as cu

        torch.cuda.init()
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device_index
        self._prop = prop
        gran = _check(cu.cuMemGetAllocationGranularity(
            prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        self.nbytes = max(gran, -(-nbytes // gran) * gran)
        self.ptr = int(_check(cu.cuMemAddressReserve(self.nbytes, 0, 0, 0)))
        self._handle = None
        self.last_map_s: dict[str, float] = {}
        self.map()
        with torch.cuda.device(self.device_index):
            self.tensor = torch.as_tensor(_ArrayInterface(self.ptr, self.nbytes, self.device_index),
                                          device=f"cuda:{self.device_index}")

    @property
    def mapped(self) -> bool:
        return self._handle is not None

    def map(self) -> None:
        """Back the address range with fresh physical memory (contents undefined)."""
        if self._handle is not None:
            return
        from cuda.bindings import driver as cu

        t0 = time.perf_counter()
        handle = _check(cu.cuMemCreate(self.nbytes, self._prop, 0))
        t1 = time.perf_counter()
        _check(cu.cuMemMap(self.ptr, self.nbytes, 0, handle, 0))
        t2 = time.perf_counter()
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device_index
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _check(cu.cuMemSetAccess(self.ptr, self.nbytes, [access], 1))
        self._handle = handle
        # where a wake's time goes (bench colocation prints it)
        self.last_map_s = {"cu_mem_create": t1 - t0, "cu_mem_map": t2 - t1,
                           "cu_mem_set_access": time.perf_counter() - t2}

    def unmap(self, sync: bool = True) -> None:
        """Give the physical memory back to the driver; the address stays reserved. `sync=False`:
        the caller knows no queued work touches this memory."""
        if self._handle is None:
            return
        from cuda.bindings import driver as cu

        if sync:
            torch.cuda.synchronize(self.device_index)
        _check(cu.cuMemUnmap(self.ptr, self.nbytes))
        _check(cu.cuMemRelease(self._handle))
        self._handle = None

    def __del__(self):
        try:
            from cuda.bindings import driver as cu

            self.unmap()
            cu.cuMemAddressFree(self.ptr, self.nbytes)
        except Exception:  # interpreter shutdown
            pass
