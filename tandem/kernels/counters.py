"""Per-device int32 counters for kernels whose last program to finish a tile does its final work
(the decode GEMM's split-K sum, decode attention's split merge).

A program adds one to its tile's counter after writing its partial result; the one that sees
`splits - 1` finishes the tile and sets the counter back to zero. So the counters are zero between
launches and a CUDA graph replays such a kernel as captured. Each kernel has its own buffer: no
two kernels share a counter, whatever overlaps (programmatic dependent launch) or runs on
another stream.
"""

from __future__ import annotations

import torch

MAX_COUNTERS = 1 << 16  # per buffer: the tiles one launch may finish this way

_BUFFERS: dict[tuple[torch.device, str], torch.Tensor] = {}


def counters(device: torch.device, owner: str) -> torch.Tensor:
    """`owner`'s counters on `device`, all zero outside a launch. Made on first use, which the
    engine's warm-up forward reaches before any CUDA graph is captured."""
    key = (torch.device(device), owner)
    if key not in _BUFFERS:
        _BUFFERS[key] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return _BUFFERS[key]
