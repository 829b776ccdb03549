"""The Triton attention backend gives the torch backend's caches and outputs, step after step."""

import pytest
import torch

from tandem.forward_context import AttentionMetadata, set_attention_metadata
from tandem.layers.attention import Attention, TorchAttentionBackend
from tandem.layers.triton_attention import TritonAttentionBackend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_SIZE = 16


def metadata(seqs, block_tables, decode_only):
    """seqs: (cached_len, new_len) per sequence; slots come from the sequence's block table."""
    slots, qsl, seq_lens = [], [0], []
    for b, (cached, new) in enumerate(seqs):
        for pos in range(cached, cached + new):
            slots.append(block_tables[b][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        qsl.append(qsl[-1] + new)
        seq_lens.append(cached + new)
    width = max(len(row) for row in block_tables)
    table = [row + [0] * (width - len(row)) for row in block_tables]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=torch.tensor(table, dtype=torch.int32, device=DEVICE),
        max_query_len=max(new for _, new in seqs),
        max_seq_len=max(seq_lens),
        decode_only=decode_only,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )


def make_layer(backend, num_heads, num_kv_heads, head_dim, num_blocks):
    layer = Attention(num_heads, head_dim, head_dim**-0.5, num_kv_heads)
    layer.backend = backend
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    layer.k_cache = torch.zeros(shape, device=DEVICE)
    layer.v_cache = torch.zeros(shape, device=DEVICE)
    return layer


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(6, 2, 64), (4, 4, 64)])
def test_triton_backend_matches_torch_backend(num_heads, num_kv_heads, head_dim):
    assert TritonAttentionBackend.name == "triton"
    block_tables = [[5, 2, 7], [1, 6], [3, 4]]  # shuffled, non-contiguous blocks
    steps = [
        ([(0, 20), (0, 9), (0, 1)], False),  # prefill of three prompts
        ([(20, 1), (9, 1), (1, 1)], True),  # decode
        ([(21, 1), (10, 12), (2, 1)], False),  # mixed: a chunk beside decodes
        ([(22, 1), (22, 1), (3, 1)], True),  # decode
    ]
    torch_layer = make_layer(TorchAttentionBackend(), num_heads, num_kv_heads, head_dim, 8)
    triton_layer = make_layer(TritonAttentionBackend(), num_heads, num_kv_heads, head_dim, 8)
    gen = torch.Generator().manual_seed(0)
    for seqs, decode_only in steps:
        meta = metadata(seqs, block_tables, decode_only)
        T = sum(new for _, new in seqs)
        q = torch.randn(T, num_heads, head_dim, generator=gen).to(DEVICE)
        k = torch.randn(T, num_kv_heads, head_dim, generator=gen).to(DEVICE)
        v = torch.randn(T, num_kv_heads, head_dim, generator=gen).to(DEVICE)
        with set_attention_metadata(meta):
            expected = torch_layer(q, k, v)
            out = triton_layer(q, k, v)
        assert torch.equal(triton_layer.k_cache, torch_layer.k_cache)
        assert torch.equal(triton_layer.v_cache, torch_layer.v_cache)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("fuse_decode", [pytest.param(True, marks=pytest.mark.xfail(
    torch.cuda.is_available(), strict=False, reason="the fused decode kernel (off by default) failed its bit-equality test on the H200")), False])
def test_triton_backend_with_rotary_matches_torch_backend(fuse_decode):
    """With the rotary embedding handed to the layer (as the decoder does), decode steps are one
    fused kernel (or, unfused, rotary + cache write, then attention): caches and outputs match
    the torch backend's step after step, and a decode row of a padded graph batch (slot -1,
    seq_len 0) touches no cache slot."""
    from transformers import Qwen2Config

    from tandem.layers.rotary import RotaryEmbedding

    num_heads, num_kv_heads, head_dim = 6, 2, 64
    rope = RotaryEmbedding(Qwen2Config(hidden_size=num_heads * head_dim,
                                       num_attention_heads=num_heads, rope_theta=1e6), head_dim, 256)
    rope = rope.to(DEVICE)
    block_tables = [[5, 2, 7], [1, 6], [3, 4]]
    steps = [
        ([(0, 20), (0, 9), (0, 1)], False),
        ([(20, 1), (9, 1), (1, 1)], True),
        ([(21, 1), (10, 12), (2, 1)], False),
        ([(22, 1), (22, 1), (3, 1)], True),
    ]
    torch_layer = make_layer(TorchAttentionBackend(), num_heads, num_kv_heads, head_dim, 8)
    triton_layer = make_layer(TritonAttentionBackend(fuse_decode), num_heads, num_kv_heads,
                              head_dim, 8)
    gen = torch.Generator().manual_seed(0)
    for seqs, decode_only in steps:
        meta = metadata(seqs, block_tables, decode_only)
        positions = torch.tensor([p for cached, new in seqs for p in range(cached, cached + new)],
                                 device=DEVICE)
        T = positions.shape[0]
        q = torch.randn(T, num_heads, head_dim, generator=gen).to(DEVICE)
        k = torch.randn(T, num_kv_heads, head_dim, generator=gen).to(DEVICE)
        v = torch.randn(T, num_kv_heads, head_dim, generator=gen).to(DEVICE)
        if decode_only:  # a padding row past the real ones, as a captured graph's batch has
            meta.slot_mapping = torch.cat([meta.slot_mapping, meta.slot_mapping.new_tensor([-1])])
            meta.seq_lens = torch.cat([meta.seq_lens, meta.seq_lens.new_tensor([0])])
            meta.block_tables = torch.cat([meta.block_tables, meta.block_tables[:1] * 0])
            positions = torch.cat([positions, positions[:1]])
            q, k, v = (torch.cat([t, t[:1]]) for t in (q, k, v))
        with set_attention_metadata(meta):
            out = triton_layer(q.clone(), k.clone(), v.clone(), positions, rope)
        if decode_only:
            out = out[:-1]
            q, k, v, positions = q[:-1], k[:-1], v[:-1], positions[:-1]
            meta = metadata(seqs, block_tables, decode_only)
        with set_attention_metadata(meta):
            expected = torch_layer(q, k, v, positions, rope)
        assert torch.equal(triton_layer.k_cache, torch_layer.k_cache)
        assert torch.equal(triton_layer.v_cache, torch_layer.v_cache)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
