"""Triton split-KV paged decode attention against `paged_attention_ref`."""

import numpy as np
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
    [DecodeConfig(1, 16, 4, 2), DecodeConfig(2, 16, 4, 5), DecodeConfig(2, 32, 8, 3),
     DecodeConfig(1, 32, 4, 5), DecodeConfig(2, 32, 4, 4)],
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


def test_decode_config_by_programs_per_sm():
    """Two 128-dim kv heads a program: the batch picks the config (a CPU counts the H200's 132
    SMs); other shapes keep the one config, whatever the batch."""
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    assert decode_config(4, 128, bf16, 256, cpu) == DecodeConfig(2, 32, 4, 4)  # 512 programs
    assert decode_config(8, 128, bf16, 67, cpu) == DecodeConfig(2, 32, 4, 4)  # 268
    assert decode_config(2, 128, bf16, 256, cpu) == DecodeConfig(1, 32, 4, 5)  # 256: one head each
    assert decode_config(4, 128, bf16, 67, cpu) == DecodeConfig(1, 32, 4, 5)  # 134
    assert decode_config(2, 128, bf16, 132, cpu) == DecodeConfig(2, 32, 4, 5)  # 132: splits fill
    assert decode_config(2, 128, bf16, 1, cpu) == decode_config(2, 128, bf16)
    for shape, dtype in [((3, 64), bf16), ((8, 64), bf16), ((4, 128), torch.float32)]:
        assert decode_config(*shape, dtype, 256, cpu) == decode_config(*shape, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("num_kv_heads,group,batch,max_len", [
    (4, 7, 160, 700), (2, 6, 160, 700), (8, 4, 70, 700), (2, 6, 40, 2048), (4, 7, 48, 2048),
])
def test_decode_batch_sized_configs_gpu(num_kv_heads, group, batch, max_len, paged_kv, close):
    """The configs batches get (four stages; one kv head a program; two kv heads a program with
    the keys split), through the default launch, in bf16 with random lengths, against the
    reference."""
    gen = torch.Generator().manual_seed(3)
    seq_lens = torch.randint(1, max_len, (batch,), generator=gen).tolist()
    q, k_cache, v_cache, seq_lens_t, block_tables = make_case(
        seq_lens, num_kv_heads, group, 128, 16, torch.bfloat16, "cuda", paged_kv
    )
    out = decode_attention(q, k_cache, v_cache, seq_lens_t, block_tables, 128**-0.5)
    close(out, reference(q, k_cache, v_cache, seq_lens, block_tables, 128**-0.5))


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


def fused_case(seq_lens, num_kv_heads, group, head_dim, block_size, dtype, device, paged_kv):
    """A decode step: each sequence's new token (the last of its seq_lens keys) as q, k, v views
    of one projection output, with its position and cache slot (-1 for a seq_len-0 padding row)."""
    from transformers import Qwen2Config

    from tandem.layers.rotary import RotaryEmbedding

    k_cache, v_cache, block_tables = paged_kv(seq_lens, num_kv_heads, head_dim, block_size,
                                              dtype, device)
    B, N, K = len(seq_lens), num_kv_heads * group, num_kv_heads
    gen = torch.Generator().manual_seed(5)
    qkv = (2 * torch.randn(B, (N + 2 * K) * head_dim, generator=gen)).to(device, dtype)
    q, k, v = (t.view(B, -1, head_dim) for t in qkv.split([N * head_dim, K * head_dim,
                                                          K * head_dim], dim=-1))
    tables = block_tables.tolist()
    slots = [tables[b][(n - 1) // block_size] * block_size + (n - 1) % block_size if n else -1
             for b, n in enumerate(seq_lens)]
    rope = RotaryEmbedding(Qwen2Config(hidden_size=N * head_dim, num_attention_heads=N,
                                       rope_theta=1e6), head_dim, 4096).to(device)
    return {
        "positions": torch.tensor([max(n - 1, 0) for n in seq_lens], device=device),
        "q_BNH": q, "k_BKH": k, "v_BKH": v,
        "cos_cache": rope.cos_cache, "sin_cache": rope.sin_cache,
        "k_cache": k_cache, "v_cache": v_cache,
        "slot_mapping": torch.tensor(slots, dtype=torch.int64, device=device),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=device),
        "block_tables": block_tables, "scale": head_dim**-0.5,
    }


def two_kernel_path(c, num_splits):
    """What the attention layer launched before the fusion: rotary + cache write, then attention."""
    from tandem.kernels.rotary import apply_rotary_and_store_kv

    q, k, v = c["q_BNH"].clone(), c["k_BKH"].clone(), c["v_BKH"].clone()
    k_cache, v_cache = c["k_cache"].clone(), c["v_cache"].clone()
    apply_rotary_and_store_kv(c["positions"], q, k, v, c["cos_cache"], c["sin_cache"], k_cache,
                              v_cache, c["slot_mapping"])
    out = decode_attention(q, k_cache, v_cache, c["seq_lens"], c["block_tables"], c["scale"],
                           num_splits)
    return out, k_cache, v_cache


def torch_path(c):
    """The torch backend's arithmetic, in fp32: rotate, store, attend (no Triton)."""
    from tandem.kernels.attention_ref import store_kvcache_ref
    from tandem.kernels.rotary_ref import apply_rotary_ref

    q, k = apply_rotary_ref(c["positions"], c["q_BNH"], c["k_BKH"], c["cos_cache"], c["sin_cache"])
    k_cache, v_cache = c["k_cache"].clone(), c["v_cache"].clone()
    store_kvcache_ref(k, c["v_BKH"], k_cache, v_cache, c["slot_mapping"])
    return reference(q, k_cache, v_cache, c["seq_lens"].tolist(), c["block_tables"], c["scale"])


@pytest.mark.parametrize(
    "num_kv_heads,group,head_dim,block_size",
    [(2, 6, 128, 16), (4, 2, 128, 8), (1, 3, 80, 16), (3, 1, 64, 32)],
)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # bf16: the GPU test below
def test_fused_rotary_store_decode_equals_two_kernels(
    num_kv_heads, group, head_dim, block_size, num_splits, dtype, device, paged_kv, close
):
    """One launch gives the two-kernel path's output and cache bit for bit (4 kv heads: two
    programs per sequence, each writing its own heads; a seq_len-0 padding row writes nothing),
    and the torch backend's attention within tolerance; its inputs are left unrotated."""
    from tandem.kernels.decode_attention import rotary_store_decode_attention

    c = fused_case([1, 7, 33, 0, 100, 16], num_kv_heads, group, head_dim, block_size, dtype,
                   device, paged_kv)
    q0, k0 = c["q_BNH"].clone(), c["k_BKH"].clone()
    want, want_k, want_v = two_kernel_path(c, num_splits)
    out = rotary_store_decode_attention(**c, num_splits=num_splits)
    assert torch.equal(c["q_BNH"], q0) and torch.equal(c["k_BKH"], k0)
    assert torch.equal(c["k_cache"].nan_to_num(7.0), want_k.nan_to_num(7.0))
    assert torch.equal(c["v_cache"].nan_to_num(7.0), want_v.nan_to_num(7.0))
    assert torch.equal(out, want)
    if dtype == torch.float32:
        close(out, torch_path(c))


@pytest.mark.gpu
@pytest.mark.parametrize("num_kv_heads,group,batch", [(2, 6, 8), (4, 7, 8), (4, 7, 160), (2, 6, 160),
                                                      (8, 4, 70)])
def test_fused_rotary_store_decode_bf16_in_a_cuda_graph(num_kv_heads, group, batch, paged_kv):
    """bf16 on the GPU, captured once and replayed: bit for bit the two-kernel path (the cache
    write is read back by the program that made it: the barrier must order it). Batches past
    one program per SM take the batch-sized configs (`decode_config`)."""
    from tandem.kernels.decode_attention import rotary_store_decode_attention

    seq_lens = [1, 15, 16, 17, 384, 1000, 0, 3]
    if batch > len(seq_lens):
        gen = torch.Generator().manual_seed(4)
        seq_lens += torch.randint(1, 1100, (batch - len(seq_lens),), generator=gen).tolist()
    c = fused_case(seq_lens, num_kv_heads, group, 128, 16, torch.bfloat16, "cuda", paged_kv)
    want, want_k, want_v = two_kernel_path(c, None)
    rotary_store_decode_attention(**c)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rotary_store_decode_attention(**c)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    assert torch.equal(c["k_cache"].nan_to_num(7.0), want_k.nan_to_num(7.0))
    assert torch.equal(c["v_cache"].nan_to_num(7.0), want_v.nan_to_num(7.0))


def test_batch_invariant_decode_keeps_one_config_at_every_batch(device, paged_kv, monkeypatch):
    """Batch-invariant mode's per-query attention launches the batch-free config even where a
    batch that large gets another (two 128-dim kv heads, 134 rows: past one program per SM), and
    a sequence's output is the same bits alone and among the 134."""
    from tandem.forward_context import AttentionMetadata
    from tandem.layers import triton_attention

    seen = []

    def spy(*args, config=None, **kwargs):
        seen.append(config)
        return decode_attention(*args, config=config, **kwargs)

    monkeypatch.setattr(triton_attention, "decode_attention", spy)
    seq_lens = [3 + i % 5 for i in range(134)]
    q, k_cache, v_cache, seq_lens_t, block_tables = make_case(
        seq_lens, 2, 6, 128, 16, torch.float16, device, paged_kv
    )

    def step(n):
        meta = AttentionMetadata(
            slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=device),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
            seq_lens=seq_lens_t[:n], block_tables=block_tables[:n], max_query_len=1,
            max_seq_len=max(seq_lens[:n]), decode_only=True, query_start_loc_cpu=[], seq_lens_cpu=[])
        return triton_attention.per_query_decode_attention(q[:n], k_cache, v_cache, meta, 0.1)

    full, alone = step(134), step(1)
    assert decode_config(2, 128, torch.float16, 134, torch.device(device)) != decode_config(2, 128, torch.float16)
    assert seen == [decode_config(2, 128, torch.float16)] * 2
    assert torch.equal(full[:1], alone)


def apply_rotary_for(c):
    """The case's q and k rotated at its positions (the torch reference)."""
    from tandem.kernels.rotary_ref import apply_rotary_ref

    return apply_rotary_ref(c["positions"], c["q_BNH"], c["k_BKH"], c["cos_cache"], c["sin_cache"])


def merged_in_kernel(config: DecodeConfig) -> DecodeConfig:
    from dataclasses import replace

    return replace(config, fused_merge=True)


@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(2, 6, 128), (4, 2, 64), (1, 3, 80)])
@pytest.mark.parametrize("num_splits", [2, 5, 16])
@pytest.mark.parametrize("heads_kv", [1, 2])
def test_fused_merge_matches_the_merge_kernel(num_kv_heads, group, head_dim, num_splits, heads_kv,
                                              device, paged_kv, close):
    """The last split of each (sequence, kv block) merges them in the attention kernel: the merge
    kernel's output (the sum in split order against its reduction tree: within 2 ulps of fp32),
    the reference's within tolerance; more splits than keys and a seq_len-0 padding row (zeros)
    included; the counters are zero again after the launch."""
    from tandem.kernels.counters import counters

    if num_kv_heads % heads_kv:
        pytest.skip("heads_kv must divide the kv heads")
    seq_lens = [1, 7, 33, 0, 100, 16]
    q, k_cache, v_cache, seq_lens_t, block_tables = make_case(
        seq_lens, num_kv_heads, group, head_dim, 16, torch.float32, device, paged_kv
    )
    separate = DecodeConfig(heads_kv, 16, 4, 2)
    scale = head_dim**-0.5
    want = decode_attention(q, k_cache, v_cache, seq_lens_t, block_tables, scale, num_splits, separate)
    out = decode_attention(q, k_cache, v_cache, seq_lens_t, block_tables, scale, num_splits,
                           merged_in_kernel(separate))
    torch.testing.assert_close(out, want, atol=1e-6, rtol=2.5e-7)
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    close(out, reference(q, k_cache, v_cache, seq_lens, block_tables, scale))
    assert int(counters(q.device, "decode_attention").abs().sum()) == 0


@pytest.mark.parametrize("num_splits", [1, 3])
def test_fused_merge_in_the_rotary_kernel(num_splits, device, paged_kv):
    """The layer's one-launch decode step with its splits merged in the kernel: the two-kernel
    path's cache bit for bit and its output within fp32 rounding (one split: nothing to merge,
    the same bits)."""
    from tandem.kernels.decode_attention import rotary_store_decode_attention

    c = fused_case([1, 7, 33, 0, 100, 16], 2, 6, 128, 16, torch.float32, device, paged_kv)
    want, want_k, want_v = two_kernel_path(c, num_splits)
    cfg = decode_config(2, 128, torch.float32, 6, torch.device(device))  # the two-kernel path's
    out = rotary_store_decode_attention(**c, num_splits=num_splits, config=merged_in_kernel(cfg))
    assert torch.equal(c["k_cache"].nan_to_num(7.0), want_k.nan_to_num(7.0))
    assert torch.equal(c["v_cache"].nan_to_num(7.0), want_v.nan_to_num(7.0))
    if num_splits == 1:
        assert torch.equal(out, want)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=2.5e-7)


def test_decode_config_merges_in_kernel_only_when_switched_on(monkeypatch):
    """`TANDEM_FUSED_SPLIT_MERGE=1` (read at import) gives every default config the fused merge;
    unset, none has it."""
    from tandem.kernels import decode_attention as module

    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    shapes = [(2, 128, bf16, 256, cpu), (4, 128, bf16, 256, cpu), (2, 128, bf16, 64, cpu), (8, 64, bf16)]
    monkeypatch.setattr(module, "FUSED_MERGE", False)
    assert not any(decode_config(*s).fused_merge for s in shapes)
    monkeypatch.setattr(module, "FUSED_MERGE", True)
    assert all(decode_config(*s).fused_merge for s in shapes)


@pytest.mark.gpu
@pytest.mark.parametrize("num_kv_heads,group,batch", [(2, 6, 1), (2, 6, 16), (2, 6, 100), (4, 7, 33)])
def test_fused_merge_bf16_in_a_cuda_graph(num_kv_heads, group, batch, paged_kv, close):
    """bf16 on the GPU through the engine's kernel, captured once and replayed with new lengths:
    the merge-kernel path's output within one bf16 rounding, the cache bit for bit, the reference
    within tolerance, the counters zero after each replay."""
    from tandem.kernels.counters import counters
    from tandem.kernels.decode_attention import rotary_store_decode_attention

    gen = torch.Generator().manual_seed(6)
    seq_lens = torch.randint(1, 2000, (batch,), generator=gen).tolist()
    c = fused_case(seq_lens, num_kv_heads, group, 128, 16, torch.bfloat16, "cuda", paged_kv)
    cfg = decode_config(num_kv_heads, 128, torch.bfloat16, batch, torch.device("cuda"))
    assert default_num_splits(batch, num_kv_heads, c["block_tables"].shape[1] * 16,
                              torch.device("cuda"), cfg.heads_kv) > 1, "the case must split"
    want, want_k, want_v = two_kernel_path(c, None)
    fused = merged_in_kernel(cfg)
    rotary_store_decode_attention(**c, config=fused)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rotary_store_decode_attention(**c, config=fused)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, want, atol=0, rtol=2**-7)
    assert torch.equal(c["k_cache"].nan_to_num(7.0), want_k.nan_to_num(7.0))
    assert int(counters(out.device, "decode_attention").abs().sum()) == 0
    shorter = [max(1, n // 3) for n in seq_lens]
    c["seq_lens"].copy_(torch.tensor(shorter, dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    q_rot, _ = apply_rotary_for(c)
    close(out, reference(q_rot, c["k_cache"], c["v_cache"], shorter, c["block_tables"], c["scale"]))
    assert int(counters(out.device, "decode_attention").abs().sum()) == 0


def test_balanced_order_deals_the_longest_first_in_snaking_rounds():
    """Rounds of num_sms // programs_per_seq sequences, longest first, every other round reversed
    (a last partial round too); int32, a permutation; ties keep batch order."""
    from tandem.kernels.decode_attention import balanced_order

    lens = [5, 1, 9, 3, 7, 2]
    order = balanced_order(lens, programs_per_seq=1, num_sms=2)
    assert order.dtype == np.int32 and order.tolist() == [2, 4, 3, 0, 5, 1]
    assert balanced_order(lens, programs_per_seq=2, num_sms=4).tolist() == [2, 4, 3, 0, 5, 1]
    assert balanced_order(lens[:5], 1, 2).tolist() == [2, 4, 3, 0, 1]  # rounds [9 7] [3 5], then 1
    assert balanced_order(lens[:5], 1, 4).tolist() == [2, 4, 0, 3, 1]  # one full round, then 1
    assert balanced_order([4, 4, 4], 1, 2).tolist() == [0, 1, 2]
    assert balanced_order([], 4, 132).tolist() == []
    assert balanced_order(lens, 200, 132).tolist() == [2, 4, 0, 3, 5, 1]  # one a round: longest first


@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("fused_merge", [False, True])
def test_an_order_moves_programs_not_the_output(num_splits, fused_merge, device, paged_kv):
    """Launched in any order of the batch's sequences (`order=`), decode attention and the
    layer's fused rotary step give the same bits and the same cache as in batch order."""
    from tandem.kernels.decode_attention import balanced_order, rotary_store_decode_attention

    seq_lens = [1, 7, 33, 0, 100, 16]
    cfg = DecodeConfig(2, 16, 4, 2, fused_merge=fused_merge)
    q, k_cache, v_cache, seq_lens_t, block_tables = make_case(
        seq_lens, 2, 6, 64, 16, torch.float32, device, paged_kv
    )
    order = torch.tensor(balanced_order(seq_lens, 2, 4), device=device)
    assert order.tolist() != list(range(6))
    plain = decode_attention(q, k_cache, v_cache, seq_lens_t, block_tables, 0.125, num_splits, cfg)
    ordered = decode_attention(q, k_cache, v_cache, seq_lens_t, block_tables, 0.125, num_splits, cfg,
                               order=order)
    assert torch.equal(ordered, plain)
    c = fused_case(seq_lens, 2, 6, 128, 16, torch.float32, device, paged_kv)
    c2 = {**c, "k_cache": c["k_cache"].clone(), "v_cache": c["v_cache"].clone()}
    want = rotary_store_decode_attention(**c, num_splits=num_splits, config=cfg)
    got = rotary_store_decode_attention(**c2, num_splits=num_splits, config=cfg, order=order)
    assert torch.equal(got, want)
    assert torch.equal(c2["k_cache"].nan_to_num(7.0), c["k_cache"].nan_to_num(7.0))
    with pytest.raises(AssertionError, match="order must be int32"):
        decode_attention(q, k_cache, v_cache, seq_lens_t, block_tables, 0.125, order=order.long())
