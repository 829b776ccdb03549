"""Triton split-KV paged decode attention against `paged_attention_ref`."""

import pytest
import torch

from tandem.kernels.attention_ref import paged_attention_ref
from tandem.kernels.decode_attention import (
    DecodeConfig,
    decode_attention,
    decode_config,
    default_num_splits,
    heads_per_program,
)


def make_case(seq_lens, num_kv_heads, group, head_dim, block_size, dtype, device, paged_kv,
              max_blocks=None):
    k_cache, v_cache, block_tables = paged_kv(
        seq_lens, num_kv_heads, head_dim, block_size, dtype, device, max_blocks=max_blocks
    )
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen).to(device, dtype)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, seq_lens_t, block_tables


def reference(q, k_cache, v_cache, seq_lens, block_tables, scale):
    qsl = list(range(q.shape[0] + 1))
    return paged_attention_ref(
        q.float(), k_cache.float(), v_cache.float(), qsl, seq_lens, block_tables, scale
    )


@pytest.mark.parametrize(
    "num_kv_heads,group,head_dim,block_size",
    [(2, 1, 64, 16), (1, 3, 128, 16), (2, 4, 64, 8), (1, 7, 64, 32)],
)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode_matches_reference(
    num_kv_heads, group, head_dim, block_size, num_splits, device, paged_kv, close
):
    seq_lens = [1, 7, 33, 100, 16]
    q, k_cache, v_cache, seq_lens_t, block_tables = make_case(
        seq_lens, num_kv_heads, group, head_dim, block_size, torch.float32, device, paged_kv
    )
    scale = head_dim**-0.5
    out = decode_attention(q, k_cache, v_cache, seq_lens_t, block_tables, scale, num_splits)
    assert out.dtype == q.dtype and out.shape == q.shape
    close(out, reference(q, k_cache, v_cache, seq_lens, block_tables, scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_model_shape(dtype, device, paged_kv, close):
    """12 query heads over 2 kv heads (group 6), head_dim 128: the 1.5B target's layout."""
    seq_lens = [3, 70, 129]
    q, k_cache, v_cache, seq_lens_t, block_tables = make_case(
        seq_lens, 2, 6, 128, 16, dtype, device, paged_kv
    )
    out = decode_attention(q, k_cache, v_cache, seq_lens_t, block_tables, 128**-0.5, 2)
    close(out, reference(q, k_cache, v_cache, seq_lens, block_tables, 128**-0.5))


def test_decode_more_splits_than_keys(device, paged_kv, close):
    """Splits past a sequence's end contribute nothing (seq_len < num_splits)."""
    seq_lens = [1, 3, 12, 40]
    q, k_cache, v_cache, seq_lens_t, block_tables = make_case(
        seq_lens, 2, 3, 64, 16, torch.float32, device, paged_kv
    )
    out = decode_attention(q, k_cache, v_cache, seq_lens_t, block_tables, 0.125, num_splits=8)
    close(out, reference(q, k_cache, v_cache, seq_lens, block_tables, 0.125))


@pytest.mark.parametrize("num_kv_heads", [1, 2])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_empty_sequence_gives_zeros(num_kv_heads, num_splits, device, paged_kv):
    """A padding row (seq_len 0, as in a padded CUDA-graph batch) is finite: zeros."""
    q, k_cache, v_cache, _, block_tables = make_case(
        [5, 0], num_kv_heads, 2, 64, 16, torch.float32, device, paged_kv
    )
    seq_lens_t = torch.tensor([5, 0], dtype=torch.int32, device=device)
    out = decode_attention(q, k_cache, v_cache, seq_lens_t, block_tables, 0.125, num_splits)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isfinite(out[0]).all()


@pytest.mark.parametrize(
    "config",
    [DecodeConfig(1, 16, 4, 2), DecodeConfig(2, 16, 4, 5), DecodeConfig(2, 32, 8, 3)],
)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_launch_configs_agree(config, num_splits, device, paged_kv, close):
    """One kv head per program or two stacked block-diagonally: the same attention."""
    seq_lens = [1, 16, 17, 50]
    q, k_cache, v_cache, seq_lens_t, block_tables = make_case(
        seq_lens, 2, 6, 128, 16, torch.float32, device, paged_kv
    )
    out = decode_attention(q, k_cache, v_cache, seq_lens_t, block_tables, 0.09, num_splits, config)
    close(out, reference(q, k_cache, v_cache, seq_lens, block_tables, 0.09))


def test_decode_head_dim_not_a_power_of_two(device, paged_kv, close):
    seq_lens = [9, 40]
    q, k_cache, v_cache, seq_lens_t, block_tables = make_case(
        seq_lens, 2, 3, 80, 16, torch.float16, device, paged_kv
    )
    for num_splits in (1, 2):
        out = decode_attention(q, k_cache, v_cache, seq_lens_t, block_tables, 80**-0.5, num_splits)
        close(out, reference(q, k_cache, v_cache, seq_lens, block_tables, 80**-0.5))


def test_heads_per_program_fills_a_256_wide_row():
    assert heads_per_program(2, 128) == 2  # Qwen2.5-1.5B: both kv heads in one program
    assert heads_per_program(4, 128) == 2  # Qwen2.5-7B
    assert heads_per_program(8, 64) == 4
    assert heads_per_program(3, 64) == 1  # must divide the kv heads
    assert heads_per_program(1, 256) == 1
    assert decode_config(2, 128, torch.bfloat16) == DecodeConfig(2, 32, 4, 5)


def test_default_num_splits_depends_on_shapes_only():
    cpu = torch.device("cpu")
    assert default_num_splits(256, 2, 4096, cpu) == 1  # 512 programs: enough without splitting
    assert default_num_splits(256, 2, 4096, cpu, heads_kv=2) == 1
    assert default_num_splits(64, 2, 4096, cpu, heads_kv=2) == 4
    assert default_num_splits(1, 2, 32768, cpu) == 16
    assert default_num_splits(4, 8, 64, cpu) == 2  # never fewer than 32 keys per split


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(2, 6, 128), (4, 1, 64), (2, 3, 64)])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_decode_half_precision_gpu(
    dtype, num_kv_heads, group, head_dim, num_splits, paged_kv, close
):
    seq_lens = [1, 15, 16, 17, 384, 1000, 2049, 3]
    q, k_cache, v_cache, seq_lens_t, block_tables = make_case(
        seq_lens, num_kv_heads, group, head_dim, 16, dtype, "cuda", paged_kv
    )
    scale = head_dim**-0.5
    out = decode_attention(q, k_cache, v_cache, seq_lens_t, block_tables, scale, num_splits)
    close(out, reference(q, k_cache, v_cache, seq_lens, block_tables, scale))


@pytest.mark.gpu
def test_decode_cuda_graph_replay_with_new_seq_lens(paged_kv, close):
    """Captured once, replayed after seq_lens change in place (shorter and longer)."""
    max_lens = [300, 64, 1000, 5]
    q, k_cache, v_cache, seq_lens_t, block_tables = make_case(
        max_lens, 2, 6, 128, 16, torch.bfloat16, "cuda", paged_kv, max_blocks=64
    )
    decode_attention(q, k_cache, v_cache, seq_lens_t, block_tables, 0.1)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k_cache, v_cache, seq_lens_t, block_tables, 0.1)
    for lens in ([300, 64, 1000, 5], [1, 2, 17, 3], [299, 63, 513, 1]):
        seq_lens_t.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        close(out, reference(q, k_cache, v_cache, lens, block_tables, 0.1))
