"""Micro-benchmark of the Triton attention kernels on one GPU.

    python -m tandem.kernels.bench_attention [--batch 256 --context 384 --heads 12 --kv-heads 2]

Decode is memory-bound: the table reports GB/s of KV cache read. Prefill reports TFLOP/s of the
causal attention matmuls. Ends with one line of JSON.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing

from tandem.kernels.decode_attention import decode_attention, default_num_splits
from tandem.kernels.prefill_attention import prefill_attention


def paged_cache(batch, context, kv_heads, head_dim, block_size, dtype):
    """Random cache with each sequence on shuffled blocks; returns k, v, block_tables."""
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device="cuda")
    v_cache = torch.randn(shape, dtype=dtype, device="cuda")
    perm = torch.randperm(num_blocks, device="cuda", dtype=torch.int32)
    return k_cache, v_cache, perm.view(batch, blocks_per_seq)


def bench_decode(args, num_splits):
    dtype = getattr(torch, args.dtype)
    k_cache, v_cache, block_tables = paged_cache(
        args.batch, args.context, args.kv_heads, args.head_dim, args.block_size, dtype
    )
    q = torch.randn(args.batch, args.heads, args.head_dim, dtype=dtype, device="cuda")
    seq_lens = torch.full((args.batch,), args.context, dtype=torch.int32, device="cuda")
    scale = args.head_dim**-0.5
    ms = triton.testing.do_bench(
        lambda: decode_attention(q, k_cache, v_cache, seq_lens, block_tables, scale, num_splits)
    )
    kv_bytes = 2 * args.batch * args.context * args.kv_heads * args.head_dim * dtype.itemsize
    return {"kernel": "decode", "splits": num_splits, "us": ms * 1e3, "GB/s": kv_bytes / ms / 1e6}


def bench_prefill(args, prompt_len, num_prompts):
    dtype = getattr(torch, args.dtype)
    k_cache, v_cache, block_tables = paged_cache(
        num_prompts, prompt_len, args.kv_heads, args.head_dim, args.block_size, dtype
    )
    q = torch.randn(num_prompts * prompt_len, args.heads, args.head_dim, dtype=dtype, device="cuda")
    qsl = torch.arange(0, num_prompts + 1, dtype=torch.int32, device="cuda") * prompt_len
    seq_lens = torch.full((num_prompts,), prompt_len, dtype=torch.int32, device="cuda")
    scale = args.head_dim**-0.5
    ms = triton.testing.do_bench(
        lambda: prefill_attention(
            q, k_cache, v_cache, qsl, seq_lens, block_tables, prompt_len, scale
        )
    )
    # QK^T and PV, each 2*H flops per (query, key) pair, over the causal half.
    flops = 4 * args.head_dim * args.heads * num_prompts * prompt_len * (prompt_len + 1) / 2
    return {"kernel": f"prefill {num_prompts}x{prompt_len}", "us": ms * 1e3,
            "TFLOP/s": flops / ms / 1e9}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=384)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = p.parse_args()

    default = default_num_splits(
        args.batch, args.kv_heads, args.context, torch.device("cuda")
    )
    rows = [bench_decode(args, s) for s in sorted({1, 2, 4, default})]
    rows.append(bench_prefill(args, 1024, 16))
    rows.append(bench_prefill(args, 4096, 2))
    print(f"{torch.cuda.get_device_name()}  {args.dtype}  heads {args.heads}/{args.kv_heads}"
          f"  head_dim {args.head_dim}  block_size {args.block_size}")
    print(f"{'kernel':<22}{'splits':>8}{'us':>10}{'GB/s':>10}{'TFLOP/s':>10}")
    for r in rows:
        splits = r.get("splits", "")
        splits = f"{splits}{'*' if splits == default else ''}"
        print(f"{r['kernel']:<22}{splits:>8}{r['us']:>10.1f}"
              f"{r.get('GB/s', float('nan')):>10.0f}{r.get('TFLOP/s', float('nan')):>10.1f}")
    print("(* default split count)")
    print(json.dumps({"args": vars(args), "default_splits": default, "results": rows}))


if __name__ == "__main__":
    main()
