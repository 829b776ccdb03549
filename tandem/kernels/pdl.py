"""Programmatic dependent launch (PDL) for the decode step's Triton kernels.

A CUDA kernel launched after another on a stream normally starts only once the earlier one has
finished and its writes have been flushed: between two kernels of a decode step's graph the GPU
idles for the launch. With PDL (Hopper and newer) the later kernel's programs are placed on the
SMs while the earlier kernel finishes, and wait at `gdc_wait()` (PTX `griddepcontrol.wait`) until
it has completed and its writes are visible. Every kernel launched this way calls `gdc_wait()`
before its first global load or store, so it reads and overwrites exactly what it would have
launched normally; only the launch latency overlaps. One exception, by the caller's word: the
cluster GEMM (`sm90_gemm`, `static_weight=True`) loads its first tiles of a model's weight, which
no kernel of a step writes, before its wait. A CUDA graph captures the dependency as a
programmatic edge.

`TANDEM_PDL=0` turns it off (an A/B switch, read once at import: `ENABLED`); it is off on CPUs,
under the Triton interpreter and on GPUs before Hopper.
"""

from __future__ import annotations

import functools
import os

import torch

ENABLED = os.environ.get("TANDEM_PDL", "1") != "0"
# A kernel lets the next one start when all its programs have exited, or once each has called
# `gdc_launch_dependents()` (PTX `griddepcontrol.launch_dependents`). With `TANDEM_PDL_EARLY=1` the
# kernels before the decode step's GEMMs (RMSNorm, SiLU-and-mul) call it right after their own
# wait, so the next GEMM's programs are placed while they run and the cluster GEMM
# (`sm90_gemm`) loads its first weight tiles then; what they write is still read only after
# the next kernel's own wait. An A/B switch, read once at import: on an H200 (2026-12-06,
# `gen-1.5b-long`, docs/benchmarks.md) it measured no gain, so it is off.
EARLY = os.environ.get("TANDEM_PDL_EARLY", "0") == "1"


@functools.cache
def _device_supports(index: int) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_wait  # noqa: F401
    except ImportError:
        return False
    if "launch_pdl" not in getattr(CUDAOptions, "__dataclass_fields__", {}):
        return False
    return torch.cuda.get_device_capability(index) >= (9, 0)


def enabled(t: torch.Tensor) -> bool:
    """Whether kernels reading `t` launch with PDL (pass it as the kernel's `PDL` and as
    `launch_pdl`)."""
    if not (ENABLED and t.is_cuda):
        return False
    return _device_supports(t.device.index if t.device.index is not None else torch.cuda.current_device())
