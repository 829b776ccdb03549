"""Where the engine's weights and KV cache live, so `sleep` can give them back and `wake_up` return.

With CUDA's virtual memory API (`cumem`) both live at fixed device addresses: sleeping unmaps the
physical pages, waking maps new ones at the same addresses, and captured CUDA graphs stay valid.
Without it (CPU, or no `cuda.bindings`), storage is freed and reallocated, and graphs are
captured again after a wake.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.engine.cumem import CuMemBuffer

_ALIGN = 256


def unique_parameters(model: nn.Module) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in model.parameters():  # tied weights are one Parameter: counted once
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


class WeightStore:
    """Owns the storage behind the model's parameters."""

    def __init__(self, model: nn.Module, device: torch.device, use_cumem: bool):
        self.params = unique_parameters(model)
        self.shapes = [p.shape for p in self.params]
        self.device = device
        self.nbytes = sum(_nbytes(p) for p in self.params)
        self.buffer: CuMemBuffer | None = None
        self.host: torch.Tensor | list[torch.Tensor] | None = None
        self._pinned: torch.Tensor | None = None
        self.resident = True
        if use_cumem:
            self._move_into_cumem()

    def _move_into_cumem(self) -> None:
        offsets, total = [], 0
        for p in self.params:
            offsets.append(total)
            total += -(-_nbytes(p) // _ALIGN) * _ALIGN
        self.buffer = CuMemBuffer(total, self.device)
        for p, off in zip(self.params, offsets):
            view = self.buffer.tensor[off : off + _nbytes(p)].view(p.dtype).view(p.shape)
            view.copy_(p.data)
            p.data = view
        torch.cuda.synchronize(self.device)

    def start_copy_out(self) -> None:
        """Queue the device-to-host copy of `release(keep_copy=True)` without waiting for it, so
        the caller can free other memory meanwhile (stable-address storage only)."""
        if self.resident and self.buffer is not None and self.host is None:
            if self._pinned is None:  # allocated once: pinning gigabytes costs more than copying
                self._pinned = torch.empty(self.buffer.nbytes, dtype=torch.uint8, pin_memory=True)
            self._pinned.copy_(self.buffer.tensor, non_blocking=True)
            self.host = self._pinned

    def release(self, keep_copy: bool) -> None:
        """Free the device memory; with `keep_copy`, keep the values in (pinned) host memory."""
        if not self.resident:
            return
        if self.device.type == "cpu" and keep_copy:
            return  # a CPU engine's weights already live in host memory
        pin = self.device.type == "cuda"
        if self.buffer is not None:
            if keep_copy:
                self.start_copy_out()
            else:
                self.host = None
            self.buffer.unmap()  # waits for the copy out
        else:
            if keep_copy:
                self.host = [p.data.to("cpu").pin_memory() if pin else p.data.clone() for p in self.params]
            for p in self.params:
                p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        self.resident = False

    def restore(self, sync: bool = True) -> bool:
        """Bring device memory back; returns whether it holds the old values (False: refill it).
        `sync=False` leaves the host-to-device copy running (the caller synchronises)."""
        if self.resident:
            return True
        had_copy = self.host is not None
        if self.buffer is not None:
            self.buffer.map()
            if had_copy:
                self.buffer.tensor.copy_(self.host, non_blocking=True)
        else:
            for i, p in enumerate(self.params):
                if had_copy:
                    p.data = self.host[i].to(self.device, non_blocking=True)
                else:
                    p.data = torch.empty(self.shapes[i], dtype=p.dtype, device=self.device)
        if self.device.type == "cuda" and sync:
            torch.cuda.synchronize(self.device)
        self.host = None
        self.resident = True
        return had_copy


class KVCacheStore:
    """Owns the KV cache tensor [layers, 2, blocks, block_size, kv_heads, head_dim]."""

    def __init__(self, shape: tuple, dtype: torch.dtype, device: torch.device, use_cumem: bool):
        self.shape, self.dtype, self.device = shape, dtype, device
        self.nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        self.buffer = CuMemBuffer(self.nbytes, device) if use_cumem else None
        self.tensor: torch.Tensor | None = None
        self._materialise()

    def _materialise(self) -> None:
        if self.buffer is not None:
            self.buffer.map()
            self.tensor = self.buffer.tensor[: self.nbytes].view(self.dtype).view(self.shape)
        else:
            self.tensor = torch.zeros(self.shape, dtype=self.dtype, device=self.device)

    @property
    def resident(self) -> bool:
        return self.buffer.mapped if self.buffer is not None else self.tensor is not None

    @property
    def stable_address(self) -> bool:
        return self.buffer is not None

    def release(self, sync: bool = True) -> None:
        if self.buffer is not None:
            self.buffer.unmap(sync)
        else:
            self.tensor = None

    def restore(self) -> None:
        if not self.resident:
            self._materialise()
