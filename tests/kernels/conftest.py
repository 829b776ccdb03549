"""Kernel tests run on CUDA when there is one, else in the Triton interpreter on CPU tensors.

TRITON_INTERPRET is read when a kernel is decorated, so it is set here, before any test module
imports `tandem.kernels`.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    return DEVICE


def build_paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    max_blocks: int | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V for each sequence on shuffled cache blocks -> (k_cache, v_cache, block_tables).

    Every slot no sequence owns is NaN, and block 0 is never handed out, so a kernel that reads a
    padded block-table entry (0) or a slot past seq_len poisons its output.
    """
    gen = torch.Generator().manual_seed(seed)
    nblocks = [-(-n // block_size) for n in seq_lens]
    max_blocks = max_blocks or max(max(nblocks), 1)
    num_blocks = 1 + sum(nblocks) + 3
    free = (1 + torch.randperm(num_blocks - 1, generator=gen)).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    for b, n in enumerate(seq_lens):
        blocks = torch.tensor([free.pop() for _ in range(nblocks[b])], dtype=torch.long)
        block_tables[b, : nblocks[b]] = blocks.int()
        pos = torch.arange(n)
        slots = blocks[pos // block_size] * block_size + pos % block_size
        for cache in (k_cache, v_cache):
            kv = torch.randn(n, num_kv_heads, head_dim, generator=gen)
            cache.view(-1, num_kv_heads, head_dim)[slots] = kv.to(dtype)
    return k_cache.to(device), v_cache.to(device), block_tables.to(device)


@pytest.fixture
def paged_kv():
    """The `build_paged_kv` helper, as a fixture so test modules need not import conftest."""
    return build_paged_kv


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    tol = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}[out.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.fixture
def close():
    return assert_close
