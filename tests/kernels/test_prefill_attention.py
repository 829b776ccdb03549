"""Triton varlen paged prefill attention against `paged_attention_ref`."""

import pytest
import torch

from tandem.kernels.attention_ref import paged_attention_ref
from tandem.kernels.prefill_attention import prefill_attention

# (seq_len, query_len): full prefills, chunks that are the tail of a longer cached context, a
# decode row inside a mixed batch, and a sequence with no queries this step.
BATCH = [(5, 5), (37, 37), (100, 30), (50, 1), (20, 0), (64, 20)]


def run_case(batch, num_kv_heads, group, head_dim, block_size, dtype, device, paged_kv, close):
    seq_lens = [n for n, _ in batch]
    q_lens = [lq for _, lq in batch]
    k_cache, v_cache, block_tables = paged_kv(
        seq_lens, num_kv_heads, head_dim, block_size, dtype, device, max_blocks=None
    )
    qsl = [0]
    for lq in q_lens:
        qsl.append(qsl[-1] + lq)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(qsl[-1], num_kv_heads * group, head_dim, generator=gen).to(device, dtype)
    scale = head_dim**-0.5
    out = prefill_attention(
        q, k_cache, v_cache,
        torch.tensor(qsl, dtype=torch.int32, device=device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables, max(q_lens), scale,
    )
    ref = paged_attention_ref(
        q.float(), k_cache.float(), v_cache.float(), qsl, seq_lens, block_tables, scale
    )
    assert out.dtype == dtype and out.shape == q.shape
    close(out, ref)


@pytest.mark.parametrize(
    "num_kv_heads,group,head_dim,block_size",
    [(2, 1, 64, 16), (1, 3, 128, 16), (2, 4, 64, 8), (1, 7, 64, 32)],
)
def test_prefill_matches_reference(
    num_kv_heads, group, head_dim, block_size, device, paged_kv, close
):
    run_case(
        BATCH, num_kv_heads, group, head_dim, block_size, torch.float32, device, paged_kv, close
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_model_shape(dtype, device, paged_kv, close):
    """12 query heads over 2 kv heads (group 6), head_dim 128: the 1.5B target's layout."""
    run_case([(40, 40), (90, 33), (12, 1)], 2, 6, 128, 16, dtype, device, paged_kv, close)


def test_prefill_head_dim_not_power_of_two(device, paged_kv, close):
    run_case([(30, 12), (9, 9)], 2, 2, 80, 16, torch.float32, device, paged_kv, close)


def test_prefill_non_contiguous_q(device, paged_kv, close):
    """q as a view into a fused qkv projection output, as models produce it."""
    k_cache, v_cache, block_tables = paged_kv([24, 10], 1, 64, 16, torch.float32, device)
    qkv = torch.randn(14, 5 * 64, device=device)
    q = qkv[:, : 3 * 64].view(14, 3, 64)
    qsl, seq_lens = [0, 4, 14], [24, 10]
    out = prefill_attention(
        q, k_cache, v_cache, torch.tensor(qsl, dtype=torch.int32, device=device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device), block_tables, 10, 0.125,
    )
    close(out, paged_attention_ref(q, k_cache, v_cache, qsl, seq_lens, block_tables, 0.125))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(2, 6, 128), (4, 1, 64), (2, 3, 64)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_half_precision_gpu(
    dtype, num_kv_heads, group, head_dim, block_size, paged_kv, close
):
    batch = [(700, 700), (1000, 257), (129, 1), (300, 64), (17, 17)]
    run_case(batch, num_kv_heads, group, head_dim, block_size, dtype, "cuda", paged_kv, close)


@pytest.mark.parametrize("group", [1, 2, 6, 7, 8, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tile_rows_classes_reach_every_tile_config(group, dtype):
    """The warm-up's query lengths reach every tile config some step can reach, once each."""
    from tandem.kernels.prefill_attention import _tile_config, tile_rows_classes

    def config(q_len):
        return _tile_config(dtype, q_len, group)

    lens = tile_rows_classes(group, dtype)
    assert lens == sorted(lens)
    assert len({config(n) for n in lens}) == len(lens)
    assert {config(n) for n in range(1, 4097)} == {config(n) for n in lens}


@pytest.mark.parametrize("group,block_size", [(6, 16), (1, 8)])
def test_prefill_padded_like_a_cuda_graph(group, block_size, device, paged_kv, close):
    """A captured mixed step: more rows than queries, sequences with no queries and no context
    after the real ones, and the tile picked for the graph's size rather than the longest query.
    Real rows match the reference; nothing reads the padding."""
    batch = [(30, 30), (61, 1), (9, 1), (40, 17)]
    seq_lens = [n for n, _ in batch]
    k_cache, v_cache, block_tables = paged_kv(seq_lens, 2, 64, block_size, torch.float32, device)
    qsl = [0]
    for _, lq in batch:
        qsl.append(qsl[-1] + lq)
    real, rows, pad_seqs = qsl[-1], 64, 5
    q = torch.randn(rows, 2 * group, 64, generator=torch.Generator().manual_seed(2)).to(device)
    tables = torch.cat([block_tables, torch.zeros(pad_seqs, block_tables.shape[1], dtype=torch.int32,
                                                  device=device)])
    out = prefill_attention(
        q, k_cache, v_cache,
        torch.tensor(qsl + [real] * pad_seqs, dtype=torch.int32, device=device),
        torch.tensor(seq_lens + [0] * pad_seqs, dtype=torch.int32, device=device),
        tables, rows, 0.125,
    )
    ref = paged_attention_ref(q[:real], k_cache, v_cache, qsl, seq_lens, block_tables, 0.125)
    close(out[:real], ref)
