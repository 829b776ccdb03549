"""Triton rotary embedding (in place) against `apply_rotary_ref` and the layer's torch path."""

import pytest
import torch
from transformers import Qwen2Config

from tandem.kernels.rotary import apply_rotary, apply_rotary_ref
from tandem.layers.rotary import RotaryEmbedding

HEAD_DIM = 64


def rope(head_dim=HEAD_DIM, max_position=4096) -> RotaryEmbedding:
    cfg = Qwen2Config(hidden_size=4 * head_dim, num_attention_heads=4, rope_theta=1e6)
    return RotaryEmbedding(cfg, head_dim, max_position)


def qkv(T, N, K, H, dtype, device, seed=0):
    """q, k, v as views of one fused projection output, as the decoder layer splits it."""
    gen = torch.Generator().manual_seed(seed)
    fused = (4 * torch.randn(T, (N + 2 * K) * H, generator=gen)).to(device, dtype)
    q, k, v = fused.split([N * H, K * H, K * H], dim=-1)
    return fused, q.view(T, N, H), k.view(T, K, H), v.view(T, K, H)


def test_reference_matches_layer_torch_path():
    layer = rope()
    _, q, k, _ = qkv(9, 6, 2, HEAD_DIM, torch.bfloat16, "cpu")
    positions = torch.tensor([0, 1, 2, 3, 100, 4095, 7, 7, 512])
    lq, lk = layer(positions, q, k)
    rq, rk = apply_rotary_ref(positions, q, k, layer.cos_cache, layer.sin_cache)
    assert torch.equal(lq, rq) and torch.equal(lk, rk)


def truncating_reference(positions, q, k, cos_cache, sin_cache):
    """The reference, each fp32 -> bf16 rounding done by truncation as the interpreter does."""

    def bf16(x):
        return (x.float().view(torch.int32) & -65536).view(torch.float32)

    def rotate(x, cos, sin):
        x1, x2 = x.float().chunk(2, dim=-1)
        rot = torch.cat((-x2, x1), dim=-1)
        return bf16(bf16(x.float() * cos) + bf16(rot * sin)).to(x.dtype)

    cos = bf16(cos_cache[positions])[:, None, :]
    sin = bf16(sin_cache[positions])[:, None, :]
    return rotate(q, cos, sin), rotate(k, cos, sin)


# The interpreter rounds fp32 -> bf16 by truncation, so there bf16 is checked against a reference
# that truncates too; fp16 rounds exactly in the interpreter; on a GPU all match bit for bit.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(6, 2, 64), (12, 2, 128), (3, 3, 80)])
def test_kernel_matches_reference(dtype, num_heads, num_kv_heads, head_dim, device):
    layer = rope(head_dim).to(device)
    _, q, k, v = qkv(13, num_heads, num_kv_heads, head_dim, dtype, device)
    v0 = v.clone()
    positions = torch.tensor([5, 0, 1, 4095, 77, 77, 3, 2048, 9, 10, 11, 12, 1000], device=device)
    ref = truncating_reference if dtype == torch.bfloat16 and device == "cpu" else apply_rotary_ref
    rq, rk = ref(positions, q, k, layer.cos_cache, layer.sin_cache)
    oq, ok = apply_rotary(positions, q, k, layer.cos_cache, layer.sin_cache)
    assert oq.data_ptr() == q.data_ptr() and ok.data_ptr() == k.data_ptr()  # in place
    assert torch.equal(v, v0)  # the value slice of the fused buffer is untouched
    assert torch.equal(q, rq) and torch.equal(k, rk)


def test_no_tokens_is_a_no_op(device):
    layer = rope().to(device)
    _, q, k, _ = qkv(0, 4, 2, HEAD_DIM, torch.float16, device)
    positions = torch.zeros(0, dtype=torch.int64, device=device)
    oq, ok = apply_rotary(positions, q, k, layer.cos_cache, layer.sin_cache)
    assert oq.shape == (0, 4, HEAD_DIM) and ok.shape == (0, 2, HEAD_DIM)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_layer_uses_kernel_on_gpu_and_matches_torch(dtype):
    layer = rope(128).cuda()
    _, q, k, _ = qkv(256, 12, 2, 128, dtype, "cuda")
    positions = torch.randint(0, 4096, (256,), device="cuda")
    rq, rk = apply_rotary_ref(positions, q, k, layer.cos_cache, layer.sin_cache)
    oq, ok = layer(positions, q, k)
    assert oq.data_ptr() == q.data_ptr()
    assert torch.equal(oq, rq) and torch.equal(ok, rk)


@pytest.mark.gpu
def test_cuda_graph_replay_with_new_positions():
    layer = rope(128).cuda()
    fused, q, k, _ = qkv(64, 12, 2, 128, torch.bfloat16, "cuda")
    source = fused.clone()
    positions = torch.zeros(64, dtype=torch.int64, device="cuda")
    apply_rotary(positions, q, k, layer.cos_cache, layer.sin_cache)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        apply_rotary(positions, q, k, layer.cos_cache, layer.sin_cache)
    for step in range(3):
        fused.copy_(source)
        positions.copy_(torch.randint(0, 4096, (64,)))
        graph.replay()
        _, q0, k0, _ = qkv(64, 12, 2, 128, torch.bfloat16, "cuda")
        rq, rk = apply_rotary_ref(positions, q0, k0, layer.cos_cache, layer.sin_cache)
        assert torch.equal(q, rq) and torch.equal(k, rk), step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [(12, 2, 128, 16), (3, 3, 80, 8)])
def test_fused_cache_write_equals_rotary_then_store(dtype, num_heads, num_kv_heads, head_dim, block_size,
                                                    device):
    """One kernel for rotary + cache write gives what the two kernels give, bit for bit; a
    padding token (slot -1) is rotated but touches no cache slot."""
    from tandem.kernels.kv_cache import store_kvcache
    from tandem.kernels.rotary import apply_rotary_and_store_kv

    layer = rope(head_dim).to(device)
    T = 9
    positions = torch.tensor([5, 0, 1, 4095, 77, 3, 2048, 9, 10], device=device)
    slots = torch.tensor([3, 17, -1, 40, 2, 63, -1, 0, 22], device=device)
    gen = torch.Generator().manual_seed(3)
    cache_shape = (64 // block_size, block_size, num_kv_heads, head_dim)
    caches = torch.randn(2, *cache_shape, generator=gen).to(device, dtype)
    fused, q, k, v = qkv(T, num_heads, num_kv_heads, head_dim, dtype, device)
    want_fused, wq, wk, wv = qkv(T, num_heads, num_kv_heads, head_dim, dtype, device)
    want_caches = caches.clone()
    apply_rotary(positions, wq, wk, layer.cos_cache, layer.sin_cache)
    store_kvcache(wk, wv, want_caches[0], want_caches[1], slots)
    oq, ok = apply_rotary_and_store_kv(positions, q, k, v, layer.cos_cache, layer.sin_cache,
                                       caches[0], caches[1], slots)
    assert oq.data_ptr() == q.data_ptr() and ok.data_ptr() == k.data_ptr()
    assert torch.equal(fused, want_fused)  # q and k rotated in place, v untouched
    assert torch.equal(caches, want_caches)


def test_reference_rotates_as_hf_does():
    """Against a hand-computed rotation and HF's `apply_rotary_pos_emb`, not against itself: at
    position p with one frequency of 1, (x1, x2) turns by p radians."""
    import math

    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cos_cache = torch.tensor([[math.cos(p)] * 2 for p in range(3)])
    sin_cache = torch.tensor([[math.sin(p)] * 2 for p in range(3)])
    q = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])  # two tokens, one head, head dim 2
    rq, rk = apply_rotary_ref(torch.tensor([1, 2]), q, q.clone(), cos_cache, sin_cache)
    expected = torch.tensor([[[math.cos(1), math.sin(1)]], [[-math.sin(2), math.cos(2)]]])
    torch.testing.assert_close(rq, expected)
    torch.testing.assert_close(rk, expected)

    cfg = LlamaConfig(hidden_size=4 * HEAD_DIM, num_attention_heads=4, rope_theta=1e6,
                      max_position_embeddings=4096)
    layer = RotaryEmbedding(cfg, HEAD_DIM, 4096)
    _, q, k, _ = qkv(9, 4, 2, HEAD_DIM, torch.float32, "cpu")
    positions = torch.tensor([0, 1, 2, 3, 100, 4095, 7, 7, 512])
    cos, sin = LlamaRotaryEmbedding(cfg)(q, positions[None])
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    rq, rk = apply_rotary_ref(positions, q, k, layer.cos_cache, layer.sin_cache)
    torch.testing.assert_close(rq, hq[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rk, hk[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
