"""Triton store_kvcache against `store_kvcache_ref`."""

import pytest
import torch

from tandem.kernels.attention_ref import store_kvcache_ref
from tandem.kernels.kv_cache import store_kvcache


def check_store(T, num_kv_heads, head_dim, block_size, src_dtype, cache_dtype, device):
    gen = torch.Generator().manual_seed(0)
    num_blocks = max(6, -(-T // block_size) + 1)
    # k and v as views into one fused qkv output: rows are not contiguous.
    qkv = torch.randn(T, 3 * num_kv_heads * head_dim, generator=gen).to(device, src_dtype)
    kv_width = num_kv_heads * head_dim
    k = qkv[:, kv_width : 2 * kv_width].view(T, num_kv_heads, head_dim)
    v = qkv[:, 2 * kv_width :].view(T, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T]
    slots[::3] = -1  # padding rows are skipped
    slot_mapping = slots.to(device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device, cache_dtype)
    v_cache = torch.randn(shape, generator=gen).to(device, cache_dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    store_kvcache_ref(k, v, k_ref, v_ref, slot_mapping)
    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)


@pytest.mark.parametrize(
    "T,num_kv_heads,head_dim,block_size", [(7, 2, 64, 16), (10, 3, 128, 8), (5, 1, 80, 16)]
)
def test_store_kvcache_matches_reference(T, num_kv_heads, head_dim, block_size, device):
    check_store(T, num_kv_heads, head_dim, block_size, torch.float32, torch.float32, device)


def test_store_kvcache_casts_to_cache_dtype(device):
    check_store(6, 2, 64, 16, torch.float32, torch.float16, device)


def test_store_kvcache_empty_batch(device):
    k = torch.empty(0, 2, 64, device=device)
    cache = torch.zeros(2, 16, 2, 64, device=device)
    store_kvcache(k, k, cache, cache.clone(), torch.empty(0, dtype=torch.long, device=device))
    assert not cache.any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_store_kvcache_half_precision_gpu(dtype):
    check_store(300, 2, 128, 16, dtype, dtype, "cuda")
