"""Micro-benchmark of the Triton attention kernels on one GPU.

    python -m tandem.bench.kernels [--batch 256 --contexts 256 384 512 1024 --heads 12
        --kv-heads 2 --baseline OLD_decode_attention.py --sweep]

Decode is memory-bound: the table reports GB/s of KV cache read and its share of `--hbm-gbs`.
Decode calls are timed as the engine runs them, inside a CUDA graph (no launch overhead), and
rotate over enough copies of the cache that L2 holds none of what a call reads. `--rotary`
times the attention layer's decode step both ways: rotary + cache write, then attention (two
kernels), and the fused `rotary_store_decode_attention` (one). `--baseline` loads another
decode_attention module from a file (e.g. an older version, from `git show`) and times it beside
the current one (with `--rotary`, its fused step too); `--sweep` also tries a grid of launch
configurations at every `--splits` count (with `--rotary`, for the fused kernel as well: the one
the engine runs). Where the keys are split, the default config is also timed merging its splits
the other way (`DecodeConfig.fused_merge`: in the attention kernel or by a second one).
`--random-lengths --orders drawn longest snake` times the default launch with the same lengths in
other orders of the batch (`order_lengths`). Prefill reports TFLOP/s of the causal attention
matmuls. Ends with one line of JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import statistics
import sys

import torch
import triton.testing
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from tandem.kernels import decode_attention as current
from tandem.kernels.prefill_attention import prefill_attention
from tandem.kernels.rotary import apply_rotary_and_store_kv

LAUNCH_ERRORS = (OutOfResources, CompilationError, RuntimeError)


def paged_cache(batch, context, kv_heads, head_dim, block_size, dtype):
    """Random cache with each sequence on shuffled blocks; returns k, v, block_tables."""
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device="cuda")
    v_cache = torch.randn(shape, dtype=dtype, device="cuda")
    perm = torch.randperm(num_blocks, device="cuda", dtype=torch.int32)
    return k_cache, v_cache, perm.view(batch, blocks_per_seq)


ORDERS = ("drawn", "longest", "snake")


def order_lengths(lens: list[int], order: str, programs_per_seq: int, num_sms: int) -> list[int]:
    """The batch's lengths in `order`, for the question whether the order of sequences in the grid
    (hence which programs share an SM) matters: "drawn" as drawn (the engine's batch order:
    arrival), "longest" longest first, "snake" as `decode_attention.balanced_order` puts them."""
    if order == "drawn":
        return list(lens)
    if order == "longest":
        return sorted(lens, reverse=True)
    return [lens[i] for i in current.balanced_order(lens, programs_per_seq, num_sms)]


def programs_per_sequence(args, context: int) -> int:
    """The default launch's programs a sequence at this batch (the cache's full block width)."""
    max_context = -(-context // args.block_size) * args.block_size
    return current.programs_per_sequence(args.batch, args.kv_heads, args.head_dim,
                                         getattr(torch, args.dtype), max_context, torch.device("cuda"))


def decode_inputs(args, context: int, seed: int, order: str = "drawn") -> dict:
    torch.manual_seed(seed)
    dtype = getattr(torch, args.dtype)
    k_cache, v_cache, block_tables = paged_cache(
        args.batch, context, args.kv_heads, args.head_dim, args.block_size, dtype
    )
    if args.random_lengths:  # the same lengths in every cache set
        gen = torch.Generator().manual_seed(1234)
        lo = min(max(1, args.min_length), context)
        lens = torch.randint(lo, context + 1, (args.batch,), generator=gen).tolist()
        if order != "drawn":
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            lens = order_lengths(lens, order, programs_per_sequence(args, context), sms)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    else:
        seq_lens = torch.full((args.batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(args.batch, args.heads, args.head_dim, dtype=dtype, device="cuda")
    return {"q_BNH": q, "k_cache": k_cache, "v_cache": v_cache, "seq_lens": seq_lens,
            "block_tables": block_tables, "scale": args.head_dim**-0.5}


def time_in_graph(calls, repeats: int = 5, replays: int = 10) -> float:
    """Median microseconds per call of `calls` (each a closure over its own inputs), replayed
    from one CUDA graph that runs each call once."""
    for call in calls:  # compile outside capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * len(calls)))
    return statistics.median(times)


class DecodeBench:
    """Cache sets for one context length, enough of them that L2 holds none between calls."""

    def __init__(self, args, context: int, order: str = "drawn"):
        self.args, self.context = args, context
        first = decode_inputs(args, context, seed=0, order=order)
        set_bytes = 2 * first["k_cache"].numel() * first["k_cache"].element_size()
        l2 = torch.cuda.get_device_properties(0).L2_cache_size
        n_sets = min(8, max(2, -(-4 * l2 // set_bytes)))
        self.sets = [first] + [decode_inputs(args, context, seed=i, order=order) for i in range(1, n_sets)]
        lens = first["seq_lens"].long()
        self.kv_bytes = int(2 * lens.sum() * args.kv_heads * args.head_dim
                            * first["k_cache"].element_size())

    def run(self, fn, label: str, **kwargs) -> dict:
        row = {"kernel": label, "context": self.context,
               **{k: (v if not hasattr(v, "__dict__") else vars(v)) for k, v in kwargs.items()}}
        try:
            us = time_in_graph([lambda s=s: fn(**s, **kwargs) for s in self.sets])
        except LAUNCH_ERRORS as e:  # e.g. a sweep config needing more shared memory than exists
            return {**row, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"}
        gbs = self.kv_bytes / us / 1e3
        return {**row, "us": us, "GB/s": gbs, "hbm%": 100 * gbs / self.args.hbm_gbs}

    def check(self, fn) -> None:
        """The current kernel agrees with `fn` (the baseline) on one input set."""
        s = self.sets[0]
        torch.testing.assert_close(current.decode_attention(**s), fn(**s), atol=2e-2, rtol=2e-2)


def with_new_token(s: dict, args) -> dict:
    """A decode set's inputs plus this step's token: q/k/v views of one projection output, its
    position (the last of seq_lens) and cache slot, and Qwen2.5's rope tables."""
    B, dtype = args.batch, s["q_BNH"].dtype
    N, K, H = args.heads, args.kv_heads, args.head_dim
    qkv = torch.randn(B, (N + 2 * K) * H, dtype=dtype, device="cuda")
    q, k, v = (t.view(B, -1, H) for t in qkv.split([N * H, K * H, K * H], dim=-1))
    pos = s["seq_lens"].long() - 1
    blocks = s["block_tables"].gather(1, (pos // args.block_size)[:, None]).squeeze(1).long()
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, H, 2, dtype=torch.float, device="cuda") / H))
    freqs = torch.arange(int(pos.max()) + 1, device="cuda", dtype=torch.float)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return {**s, "q_BNH": q, "k_BKH": k, "v_BKH": v, "positions": pos,
            "slot_mapping": blocks * args.block_size + pos % args.block_size,
            "cos_cache": emb.cos(), "sin_cache": emb.sin()}


def two_kernels(positions, q_BNH, k_BKH, v_BKH, cos_cache, sin_cache, k_cache, v_cache,
                slot_mapping, seq_lens, block_tables, scale):
    """What the attention layer launched per decode step before the fusion."""
    apply_rotary_and_store_kv(positions, q_BNH, k_BKH, v_BKH, cos_cache, sin_cache, k_cache,
                              v_cache, slot_mapping)
    return current.decode_attention(q_BNH, k_cache, v_cache, seq_lens, block_tables, scale)


def load_module(path: str, name: str = "decode_attention_baseline"):
    """Import a decode_attention.py from a file under `name` (registered first: its dataclasses
    look their module up while they are built)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def sweep_configs(args) -> list:
    out = []
    for heads_kv, block_n, warps, stages in itertools.product(
        [1, 2], [16, 32, 64], [4, 8], [2, 3, 4, 5]
    ):
        if args.kv_heads % heads_kv or heads_kv * args.head_dim > 256:
            continue
        if heads_kv * block_n * args.head_dim > 16384:  # > 32 KB per K tile: no room for stages
            continue
        out.append(current.DecodeConfig(heads_kv, block_n, warps, stages))
    return out


def sweep(bench: "DecodeBench", fn, label: str, args) -> tuple[list, list]:
    """Every sweep config at every --splits count: (the ten fastest and the failures, all rows)."""
    swept = [bench.run(fn, label, num_splits=splits, config=cfg)
             for cfg in sweep_configs(args) for splits in args.splits]
    ok = sorted((r for r in swept if "us" in r), key=lambda r: r["us"])
    return ok[:10] + [r for r in swept if "error" in r], swept


def merge_variants(bench: "DecodeBench", fn, prefix: str, cfg, default_splits: int, args) -> list:
    """The default config at the default and every --splits count above one, with the other
    way of merging splits (`DecodeConfig.fused_merge`) than the default's."""
    other = dataclasses.replace(cfg, fused_merge=not cfg.fused_merge)
    label = prefix + ("merge in kernel" if other.fused_merge else "merge kernel")
    counts = sorted({default_splits, *args.splits} - {1})
    return [bench.run(fn, label, num_splits=n, config=other) for n in counts]


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


def print_decode(rows: list[dict]) -> None:
    print(f"{'kernel':<20}{'ctx':>6}{'splits':>8}  {'config (heads_kv/block_n/warps/stages/merge)':<46}"
          f"{'us':>9}{'GB/s':>8}{'hbm%':>7}")
    for r in rows:
        cfg = r.get("config")
        cfg = "/".join(str(int(v)) for v in cfg.values()) if cfg else "default"
        splits = r.get("num_splits") or f"{r.get('default_splits', '')}*"
        if "error" in r:
            print(f"{r['kernel']:<20}{r['context']:>6}{splits:>8}  {cfg:<46}  {r['error']}")
            continue
        print(f"{r['kernel']:<20}{r['context']:>6}{splits:>8}  {cfg:<46}"
              f"{r['us']:>9.1f}{r['GB/s']:>8.0f}{r['hbm%']:>7.0f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 384, 512, 1024])
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--random-lengths", action="store_true",
                   help="seq_lens uniform in [--min-length, context] instead of all equal to it")
    p.add_argument("--min-length", type=int, default=1,
                   help="the shortest random length (gen-1.5b-long's decode: a prompt of 100-1024 "
                        "plus the tokens so far)")
    p.add_argument("--orders", nargs="+", choices=ORDERS, default=["drawn"],
                   help="with --random-lengths, also time the default launch with the batch's "
                        "sequences in these orders (`order_lengths`): does which programs share an "
                        "SM matter?")
    p.add_argument("--baseline", help="a decode_attention.py to time beside the current one")
    p.add_argument("--sweep", action="store_true",
                   help="also time a grid of launch configs, each at every --splits count (with "
                        "--rotary, the fused kernel's too)")
    p.add_argument("--splits", type=int, nargs="+", default=[1, 2, 3, 4, 8],
                   help="split counts timed besides the default")
    p.add_argument("--hbm-gbs", type=float, default=4200.0,
                   help="bandwidth the hbm%% column is relative to (H200 copy: 4200)")
    p.add_argument("--no-prefill", action="store_true")
    p.add_argument("--rotary", action="store_true",
                   help="also time rotary + cache write + attention: two kernels vs the fused one")
    args = p.parse_args()

    baseline = load_module(args.baseline) if args.baseline else None
    dtype = getattr(torch, args.dtype)
    default_cfg = current.decode_config(args.kv_heads, args.head_dim, dtype, args.batch,
                                        torch.device("cuda"))
    rows: list[dict] = []
    swept_all: list[dict] = []
    for context in args.contexts:
        bench = DecodeBench(args, context)
        default_splits = current.default_num_splits(
            args.batch, args.kv_heads, context, torch.device("cuda"), default_cfg.heads_kv
        )
        if baseline is not None:
            bench.check(baseline.decode_attention)
            base_splits = baseline.default_num_splits(
                args.batch, args.kv_heads, context, torch.device("cuda")
            )
            rows.append({**bench.run(baseline.decode_attention, "baseline"),
                         "default_splits": base_splits})
        rows.append({**bench.run(current.decode_attention, "current"),
                     "default_splits": default_splits})
        for splits in args.splits:
            rows.append(bench.run(current.decode_attention, "current", num_splits=splits))
        rows += merge_variants(bench, current.decode_attention, "", default_cfg, default_splits, args)
        if args.rotary:
            plain_sets = bench.sets
            bench.sets = [with_new_token(s, args) for s in plain_sets]
            s0 = bench.sets[0]
            fused = current.rotary_store_decode_attention(**s0)
            torch.testing.assert_close(fused, two_kernels(**{**s0, "q_BNH": s0["q_BNH"].clone(),
                                                             "k_BKH": s0["k_BKH"].clone()}),
                                       atol=0, rtol=0)
            rows.append({**bench.run(two_kernels, "rot+store,attn"), "default_splits": default_splits})
            rows.append({**bench.run(current.rotary_store_decode_attention, "fused"),
                         "default_splits": default_splits})
            rows += merge_variants(bench, current.rotary_store_decode_attention, "fused, ",
                                   default_cfg, default_splits, args)
            if baseline is not None and hasattr(baseline, "rotary_store_decode_attention"):
                rows.append(bench.run(baseline.rotary_store_decode_attention, "baseline fused"))
            if args.sweep:  # the engine's kernel: its programs also rotate q and store the token
                shown, swept = sweep(bench, current.rotary_store_decode_attention, "sweep fused", args)
                rows += shown
                swept_all += swept
            bench.sets = plain_sets
        if args.sweep:
            shown, swept = sweep(bench, current.decode_attention, "sweep", args)
            rows += shown
            swept_all += swept
        del bench
        for order in [o for o in args.orders if o != "drawn"] if args.random_lengths else []:
            ordered = DecodeBench(args, context, order)  # the same lengths, in another order
            rows.append({**ordered.run(current.decode_attention, f"current@{order}"),
                         "default_splits": default_splits})
            if args.rotary:
                ordered.sets = [with_new_token(s, args) for s in ordered.sets]
                rows.append({**ordered.run(current.rotary_store_decode_attention, f"fused@{order}"),
                             "default_splits": default_splits})
            del ordered
        torch.cuda.empty_cache()

    print(f"{torch.cuda.get_device_name()}  {args.dtype}  batch {args.batch}  heads "
          f"{args.heads}/{args.kv_heads}  head_dim {args.head_dim}  block_size {args.block_size}"
          f"  lengths {f'random from {args.min_length}' if args.random_lengths else 'equal'}  default config "
          f"{default_cfg}")
    print_decode(rows)
    print("(* default split count; decode timed in CUDA graphs with L2 defeated)")
    if not args.no_prefill:
        prefill = [bench_prefill(args, 1024, 16), bench_prefill(args, 4096, 2)]
        print(f"{'kernel':<22}{'us':>10}{'TFLOP/s':>10}")
        for r in prefill:
            print(f"{r['kernel']:<22}{r['us']:>10.1f}{r['TFLOP/s']:>10.1f}")
        rows += prefill
    print(json.dumps({"args": vars(args), "default_config": vars(default_cfg), "results": rows,
                      "swept": swept_all}))


if __name__ == "__main__":
    main()
