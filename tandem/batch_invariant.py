"""Batch-invariant numerics: one switch for the process, read by the layers (as vLLM's
`VLLM_BATCH_INVARIANT`).

With it on, every op whose result could depend on what else is in the batch runs a kernel whose
per-row arithmetic is fixed: GEMMs through one tile configuration with no split-K
(`tandem.kernels.batch_invariant.linear`), attention through the decode kernel for every query
with one split, RMSNorm/SiLU/rotary through their row-wise Triton kernels, and the sampled token's
log-prob through one row-wise log-softmax kernel. A token's logits then depend only on its own
sequence, never on the batch size, the chunking or the other rows, so a trainer that scores a
finished rollout with the same model code (`tandem.rl.scorer`) gets the engine's log-probs bit
for bit. Slower than the default kernels (no split-K, no per-shape tuning): meant for RL runs
that want trainer/engine parity exact, not for serving.

The kernels are Triton: a CUDA device, or the Triton interpreter on the CPU (TRITON_INTERPRET=1,
slow; the tests use it). Tensor parallelism is not covered (its all-reduce order is its own).
"""

from __future__ import annotations

import contextlib

from tandem.checks import check_triton_device

_enabled = False


def is_enabled() -> bool:
    return _enabled


def enable() -> None:
    """Turn batch-invariant numerics on for this process (the engine does, given
    `batch_invariant=True`); it stays on: a colocated trainer and its engine share it."""
    global _enabled
    _enabled = True


@contextlib.contextmanager
def enabled(on: bool = True):
    """Scope the switch (tests, and comparisons of the two numerics in one process)."""
    global _enabled
    prev, _enabled = _enabled, on
    try:
        yield
    finally:
        _enabled = prev


def check_supported(device_type: str) -> None:
    """ValueError naming `batch_invariant` when this device cannot run its kernels (EngineConfig
    refuses tensor parallelism with it)."""
    check_triton_device("batch_invariant=True", device_type)
