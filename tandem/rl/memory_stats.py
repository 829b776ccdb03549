"""Measured device memory per phase of a step (`memory/<phase>_peak_gib`, `_reserved_gib`): torch's
allocator peaks, plus what the engine maps outside it (its weights and KV cache in CUDA virtual
memory), so the figures compare with the memory plan's totals. Nothing is measured on a CPU."""

from __future__ import annotations

import torch

from tandem.rl.memory_plan import GIB


class PeakMemory:
    """Peaks per named phase; `begin(name)` closes the phase running and opens the next (a phase
    begun again, as train after an optimizer step, keeps its highest peak)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.current: str | None = None
        self.outside = 0  # bytes mapped outside torch's allocator during the current phase
        self.peaks: dict[str, tuple[int, int]] = {}  # phase -> (allocated, reserved)

    def begin(self, phase: str | None, outside: int = 0) -> None:
        if not self.cuda:
            return
        torch.cuda.synchronize(self.device)
        if self.current is not None:
            allocated = torch.cuda.max_memory_allocated(self.device) + self.outside
            reserved = torch.cuda.max_memory_reserved(self.device) + self.outside
            a0, r0 = self.peaks.get(self.current, (0, 0))
            self.peaks[self.current] = (max(a0, allocated), max(r0, reserved))
        torch.cuda.reset_peak_memory_stats(self.device)
        self.current, self.outside = phase, outside

    def end(self) -> None:
        self.begin(None)

    def metrics(self) -> dict[str, float]:
        """The peaks since the last call, as metrics; then forgets them."""
        out = {}
        for phase, (allocated, reserved) in self.peaks.items():
            key = phase.replace(" ", "_")
            out[f"memory/{key}_peak_gib"] = allocated / GIB
            out[f"memory/{key}_reserved_gib"] = reserved / GIB
        self.peaks = {}
        return out


def engine_outside_bytes(llm, awake: bool = False) -> int:
    """The engine's bytes mapped outside torch's allocator now, or (`awake`) while it is awake;
    0 without a colocated engine."""
    if llm is None:
        return 0
    return int(llm.memory_report().get("vmm_awake_bytes" if awake else "vmm_bytes", 0))
