"""Decode GEMM study on one GPU: cuBLAS, cuBLASLt's other algorithms, TunableOp, the Triton decode
GEMM and (on Hopper) the cluster GEMM.

    python -m tandem.bench.gemm [--models qwen2.5-1.5b qwen2.5-7b /path/to/model --rows 64 128 256
        --table-out decode_gemm_table.json --quick]

Every linear layer of a decode step (q/k/v with its bias, o, gate/up, down; shapes from
`tandem.models.presets`) at M rows, timed as the engine runs it: inside a CUDA graph, rotating
over enough weight copies that L2 holds none of the weight a call reads (the input stays hot, as
the previous kernel just wrote it). The Triton GEMM is swept over tiles and split-K counts; on a
Hopper GPU the cluster GEMM (`tandem.kernels.sm90_gemm`) over tile widths, multicast groups, K
splits and pipeline depths, and for gate/up also with SiLU-and-mul in its epilogue against
cuBLAS then the activation kernel (`sm90-glu` rows). Each row reports us, TFLOP/s, GB/s of
weight read and % of the roofline max(weight bytes / HBM, FLOPs / peak). cuBLASLt's heuristic
proposes several algorithms for a shape and `F.linear` runs its first; the first eight are timed
too (`cublaslt-algos`, bias-free shapes: that path has no bias). `--table-out` writes, per shape
and M bucket, the fastest of cuBLAS, the best Triton config, the best cluster GEMM config and the
best cuBLASLt algorithm (any but cuBLAS only where it beats cuBLAS by `--margin` and gives the
same bits run after run): the table `EngineConfig(decode_gemm=PATH)` reads; `--table-merge FILE`
starts it from an earlier table, so new buckets can be measured alone. Ends with one line of JSON.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import tempfile
from dataclasses import asdict

import torch
import torch.nn.functional as F

from tandem.bench.kernels import LAUNCH_ERRORS, time_in_graph
from tandem.kernels import cublaslt, sm90_gemm
from tandem.kernels.activation import silu_and_mul
from tandem.kernels.decode_gemm import GemmConfig, default_config, linear
from tandem.kernels.sm90_gemm import Sm90GemmConfig, Sm90GluConfig

TILES = [  # (block_m, block_n, block_k, num_warps); the 16-row tiles for M <= 32 only
    (16, 32, 128, 4), (16, 32, 256, 4), (16, 64, 128, 4), (16, 64, 256, 8), (16, 128, 64, 4),
    (64, 32, 128, 4), (64, 64, 64, 4), (64, 64, 128, 4), (64, 128, 64, 4), (64, 128, 128, 4),
    (64, 256, 64, 8), (128, 64, 64, 4), (128, 128, 64, 4), (128, 128, 64, 8), (128, 256, 64, 8),
]
QUICK_TILES = [(16, 32, 256, 4), (16, 64, 128, 4), (64, 64, 128, 4), (64, 128, 64, 4),
               (128, 128, 64, 4), (128, 128, 64, 8)]
SPLITS = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16]


def decode_shapes(model) -> list[dict]:
    """The four GEMMs of one layer of `model` (a preset name, a model directory, a .gguf file, a
    cached hub id or an in-memory transformers model, as `LLM` takes them): name, N, K, bias, and
    how many layers run it, read off the model the engine builds (on the meta device: no memory,
    no weights)."""
    from tandem.models.loader import build_model, resolve_model

    cfg = resolve_model(model, load_format="dummy").hf_config
    decoder = build_model(cfg, max_position=1, dtype=torch.bfloat16, device=torch.device("meta")).model
    layer = decoder.layers[0]
    gemms = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj,
             "gate_up": layer.mlp.gate_up_proj, "down": layer.mlp.down_proj}
    return [{"model": model, "op": op, "N": m.weight.shape[0], "K": m.weight.shape[1],
             "bias": m.bias is not None, "layers": len(decoder.layers)} for op, m in gemms.items()]


def split_candidates(M: int, N: int, K: int, cfg_tile, sms: int) -> list[int]:
    bm, bn, bk, _ = cfg_tile
    tiles = -(-M // bm) * -(-N // bn)
    return [s for s in SPLITS if (s == 1 or tiles * s <= 2.2 * sms) and K // s >= 2 * bk]


class ShapeBench:
    """Weight copies for one shape (enough that L2 holds none), one input per M."""

    def __init__(self, shape: dict, dtype: torch.dtype, l2_bytes: int):
        self.shape = shape
        N, K = shape["N"], shape["K"]
        w_bytes = N * K * torch.empty((), dtype=dtype).element_size()
        n_sets = min(16, max(2, -(-3 * l2_bytes // w_bytes)))
        self.weights = [torch.randn(N, K, device="cuda", dtype=dtype) / K**0.5 for _ in range(n_sets)]
        self.bias = torch.randn(N, device="cuda", dtype=dtype) if shape["bias"] else None
        self.w_bytes = w_bytes

    def time(self, fn, x) -> float:
        return time_in_graph([lambda w=w: fn(x, w, self.bias) for w in self.weights])


def roofline_us(M, N, K, w_bytes, hbm, flops) -> float:
    return 1e6 * max(w_bytes / hbm, 2 * M * N * K / flops)


def row(shape, M, label, us, w_bytes, hbm, flops, **extra) -> dict:
    N, K = shape["N"], shape["K"]
    roof = roofline_us(M, N, K, w_bytes, hbm, flops)
    base = {"model": shape["model"], "op": shape["op"], "layers": shape["layers"], "M": M, "N": N,
            "K": K, "impl": label, "us": us, "roofline_us": roof}
    if us is None:  # failed: no figures
        return {**base, **extra}
    return {**base, "TFLOP/s": 2 * M * N * K / us / 1e6, "GB/s": w_bytes / us / 1e3,
            "roofline%": 100 * roof / us, **extra}


def time_cublas(bench, x, lib: str | None) -> float:
    prev = torch.backends.cuda.preferred_blas_library()
    try:
        if lib is not None:
            torch.backends.cuda.preferred_blas_library(lib)
        return bench.time(F.linear, x)
    finally:
        torch.backends.cuda.preferred_blas_library(prev)


def time_tunable(bench, x, results_dir: str) -> float:
    """F.linear through TunableOp (tuned on the first call, outside the graph). On CUDA builds
    torch documents a single solution, cuBLAS's default, so this checks it costs nothing."""
    from torch.cuda import tunable

    tunable.set_filename(os.path.join(results_dir, "tunableop_results.csv"))
    tunable.enable(True)
    tunable.tuning_enable(True)
    try:
        for w in bench.weights:
            F.linear(x, w, bench.bias)
        torch.cuda.synchronize()
        return bench.time(F.linear, x)
    finally:
        tunable.tuning_enable(False)
        tunable.enable(False)


def deterministic(fn) -> bool:
    again = [fn() for _ in range(3)]
    return all(torch.equal(a, again[0]) for a in again)


def bucket_floor(m: int, rows: list[int], base: dict | None) -> int:
    """The fewest rows of the bucket `m` closes: one past the largest bucket below it, among this
    run's rows and (merged) the earlier table's."""
    below = [r for r in rows if r < m]
    below += [e["max_m"] for es in (base or {}).get("shapes", {}).values() for e in es if e["max_m"] < m]
    return max(below, default=0) + 1


def time_lt_algos(bench, shape, M, x, want, tol, cublas, args, floor: int) -> list[dict]:
    """cuBLASLt's first eight heuristic algorithms for M rows, each timed at M and at the bucket's
    fewest rows (`floor`: a table entry serves the whole bucket); the fastest right one over both
    again as "cublaslt-best", its speedup that of the summed times, never slower at either end."""
    N, K, wb = shape["N"], shape["K"], bench.w_bytes
    probes = [(M, x, cublas)]
    if floor < M:
        x_lo = torch.randn(floor, K, device=x.device, dtype=x.dtype)
        probes.append((floor, x_lo, bench.time(F.linear, x_lo)))
    rows, best = [], None
    for algo in cublaslt.heuristic_algos(M, N, K, x.dtype, x.device, count=8):
        fn = lambda x_, w, b, algo=algo: cublaslt.linear(x_, w, algo)
        err = (fn(x, bench.weights[0], None).float() - want).abs().max().item()
        times = [bench.time(fn, xp) for _, xp, _ in probes]
        r = row(shape, M, "cublaslt-algo", times[0], wb, args.hbm, args.flops, config=asdict(algo),
                max_abs_err=err, wrong=err > tol,
                probes={m: {"us": t, "cublas_us": c} for (m, _, c), t in zip(probes, times)})
        r["bucket_us"], r["bucket_cublas_us"] = sum(times), sum(c for _, _, c in probes)
        r["never_slower"] = all(t <= c for (_, _, c), t in zip(probes, times))
        rows.append(r)
        if not r["wrong"] and r["never_slower"] and (best is None or r["bucket_us"] < best["bucket_us"]):
            best = r
    if best is not None:
        algo = cublaslt.LtAlgo(**best["config"])
        same = deterministic(lambda: cublaslt.linear(x, bench.weights[0], algo))
        rows.append({**best, "impl": "cublaslt-best", "deterministic": same, "cublas_us": cublas,
                     "speedup_vs_cublas": best["bucket_cublas_us"] / best["bucket_us"]})
    return rows


def wave_widths(tiles_m: int, N: int, sms: int, glu: bool = False, count: int = 2) -> tuple[int, ...]:
    """Where N's columns take more than one wave of tiles: the `count` tile widths (multiples
    of 8 from 128 to 256 weight rows, half of them gate rows with `glu`) whose tiles fill the
    SMs' last wave best, the widest first among equals (e.g. Qwen2.5-7B's gate/up at 256 rows:
    144 rows, 264 tiles, two whole waves of 132 SMs, where 128 leaves the third wave 11% full)."""
    def tiles(width: int) -> int:
        return tiles_m * -(-N // (width // 2 if glu else width))

    widths = [w for w in range(128, 257, 16 if glu else 8) if tiles(w) > sms]
    busy = {w: tiles(w) / (-(-tiles(w) // sms) * sms) for w in widths}
    return tuple(sorted(widths, key=lambda w: (-busy[w], -w))[:count])


def sm90_candidates(M: int, N: int, K: int, sms: int, quick: bool,
                    glu: bool = False) -> list[Sm90GemmConfig]:
    """The Hopper cluster GEMM's configs worth timing for M rows: its shape-based default, then
    tile heights (64 rows up to 64; 128 and, past 128, every row in one tile: 192 or 256; from
    128 rows, in consumer warpgroups of 64 or 128 rows) x tile widths (a fixed few, and where
    N's tiles take more than one wave the two that fill the last one best) x multicast groups (of the
    weight tile across M tiles, or of the x tile across N tiles) x K splits (a split only within
    one wave of CTAs, at least two 64-deep blocks of K each) x pipeline depths. With `glu` (gate/up
    with the activation fused, N output columns) the widths count weight rows, half of them gate
    rows."""
    config_type = Sm90GluConfig if glu else Sm90GemmConfig
    configs = [sm90_gemm.default_config(M, N, K, sms, glu=glu)]
    if glu:
        widths = (96, 128, 144, 192, 256)
    else:  # 136: 132 tiles of Qwen2.5-1.5B's gate/up, one wave of an H100's or H200's SMs
        widths = (64, 96, 128, 136, 256) if quick else (64, 96, 128, 136, 160, 192, 256)
    heights = [64] if M <= 64 else [128] if M <= 128 else [128, 192, 256] if M <= 192 else [128, 256]
    widths = widths + wave_widths(-(-M // heights[-1]), N, sms, glu)
    shapes = [(m, n, wg) for m, n in itertools.product(heights, widths)
              for wg in ((64, 128) if m >= 128 else (64,)) if m % wg == 0]
    for block_m, block_n, warpgroup_m in shapes:
        tiles_m = -(-M // block_m)
        tiles_n = -(-N // (block_n // 2 if glu else block_n))
        groups = [(1, 1)] + [(c, 1) for c in (2,) if tiles_m > 1] + [(1, c) for c in (2, 4) if tiles_n >= c]
        for (cluster_m, cluster_n), split in itertools.product(groups, (1, 2, 3, 4, 6, 8)):
            tiles = -(-tiles_m // cluster_m) * cluster_m * -(-tiles_n // cluster_n) * cluster_n
            if (cluster_m * cluster_n * split > 8 or -(-K // 64) < 2 * split
                    or (split > 1 and tiles * split > 1.1 * sms) or tiles * split > 4 * sms):
                continue
            for stages in ((4,) if quick else (3, 4, 6)):
                try:
                    configs.append(config_type(block_m, block_n, stages, cluster_m, split, cluster_n,
                                               warpgroup_m))
                except ValueError:  # e.g. more shared memory than a block gets
                    continue
    return list(dict.fromkeys(configs))


def sm90_sweeps(shape: dict, M: int, sms: int, quick: bool) -> dict[bool, list[Sm90GemmConfig]]:
    """The cluster GEMM's candidates for a decode shape at M rows, by whether the activation is
    fused (gate/up only: N output columns are half its weight rows)."""
    N, K = shape["N"], shape["K"]
    sweeps = {False: sm90_candidates(M, N, K, sms, quick)}
    if shape["op"] == "gate_up":
        sweeps[True] = sm90_candidates(M, N // 2, K, sms, quick, glu=True)
    return sweeps


def sweep(bench, shape, M, x, want, tol, cublas, args, label, configs, fn, config_type) -> list[dict]:
    """Time `fn(x, w, bias, cfg)` for each config (the first is the kernel's own default), check
    each against cuBLAS's product, then the fastest right one's bits run after run: rows
    `label`(-default), then `label`-best with its speedup over cuBLAS."""
    wb = bench.w_bytes
    out, best = [], None
    for i, cfg in enumerate(dict.fromkeys(configs)):
        def run(x_, w, b, cfg=cfg):
            return fn(x_, w, b, cfg)

        try:
            err = (run(x, bench.weights[0], bench.bias).float() - want).abs().max().item()
            us = bench.time(run, x)
        except LAUNCH_ERRORS as e:
            out.append(row(shape, M, label, None, wb, args.hbm, args.flops,
                           config=asdict(cfg), error=f"{type(e).__name__}"))
            continue
        wrong = err > tol  # e.g. a split-K fix-up that read a partial too early
        r = row(shape, M, f"{label}-default" if i == 0 else label, us, wb, args.hbm,
                args.flops, config=asdict(cfg), max_abs_err=err, wrong=wrong)
        out.append(r)
        if not wrong and (best is None or us < best["us"]):
            best = r
    if best is not None:
        cfg = config_type(**best["config"])
        same = deterministic(lambda: fn(x, bench.weights[0], bench.bias, cfg))
        out.append({**best, "impl": f"{label}-best", "speedup_vs_cublas": cublas / best["us"],
                    "cublas_us": cublas, "deterministic": same})
    return out


def cublas_then_activation(x, w, b):
    return silu_and_mul(F.linear(x, w, b))


def study_glu(bench, shape, M, x, configs, args) -> list[dict]:
    """The gate/up GEMM with SiLU-and-mul in its epilogue (`sm90_gemm.gate_up_silu`) against what
    the engine runs now, cuBLAS's GEMM then the activation kernel, timed as a pair: rows
    `sm90-glu`(-default, -best; the speedup against the pair). Its table entry (backend
    `sm90-glu`) sends the MLP through it (`tandem.layers.linear.apply_mlp`)."""
    pair = bench.time(cublas_then_activation, x)
    want = cublas_then_activation(x, bench.weights[0], bench.bias).float()
    tol = 0.02 * want.abs().max().item() + 1e-3
    rows = [row(shape, M, "cublas+silu", pair, bench.w_bytes, args.hbm, args.flops)]
    return rows + sweep(bench, shape, M, x, want, tol, pair, args, "sm90-glu", configs,
                        functools.partial(sm90_gemm.gate_up_silu, static_weight=True), Sm90GluConfig)


def study_shape(shape, rows, args, dtype, sms, l2, tmp, base=None) -> list[dict]:
    bench = ShapeBench(shape, dtype, l2)
    N, K, wb = shape["N"], shape["K"], bench.w_bytes
    out = []
    for M in rows:
        x = torch.randn(M, K, device="cuda", dtype=dtype)
        want = F.linear(x, bench.weights[0], bench.bias).float()
        tol = 0.02 * want.abs().max().item() + 1e-3  # bf16 outputs: a few ulps of the largest
        cublas = bench.time(F.linear, x)
        out.append(row(shape, M, "cublas", cublas, wb, args.hbm, args.flops))
        for label in ("cublaslt", "tunableop"):
            if label in args.skip:
                continue
            try:
                us = (time_cublas(bench, x, "cublaslt") if label == "cublaslt"
                      else time_tunable(bench, x, tmp))
                out.append(row(shape, M, label, us, wb, args.hbm, args.flops))
            except (RuntimeError, AttributeError) as e:
                out.append(row(shape, M, label, None, wb, args.hbm, args.flops,
                               error=f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"))
        if "cublaslt-algos" not in args.skip and bench.bias is None and cublaslt.available():
            out += time_lt_algos(bench, shape, M, x, want, tol, cublas, args,
                                 bucket_floor(M, rows, base))
        if "triton" not in args.skip:
            configs = [default_config(M, N, K, x.device)]
            for tile in (QUICK_TILES if args.quick else TILES):
                if tile[0] > max(64, M) or (tile[0] < 64 and M > 32):
                    continue
                configs += [GemmConfig(*tile[:3], s, tile[3], stages)
                            for s in split_candidates(M, N, K, tile, sms) for stages in args.stages]
            out += sweep(bench, shape, M, x, want, tol, cublas, args, "triton", configs, linear,
                         GemmConfig)
        if ("sm90" not in args.skip and sm90_gemm.device_supported(x.device)
                and sm90_gemm.unsupported(N, K, dtype) is None):
            sweeps = sm90_sweeps(shape, M, sms, args.quick)
            out += sweep(bench, shape, M, x, want, tol, cublas, args, "sm90", sweeps[False],
                         functools.partial(sm90_gemm.linear, static_weight=True), Sm90GemmConfig)
            if True in sweeps:
                out += study_glu(bench, shape, M, x, sweeps[True], args)
    bench.weights.clear()
    torch.cuda.empty_cache()
    return out


BEST = {"triton-best": "triton", "cublaslt-best": "cublaslt", "sm90-best": "sm90",
        "sm90-glu-best": "sm90-glu"}


def make_table(results: list[dict], device: str, dtype: str, margin: float, base: dict | None = None) -> dict:
    """Per (N, K) and measured M: the fastest of the best Triton config, the best cluster GEMM
    config and the best cuBLASLt algorithm where it beats cuBLAS by `margin` (cuBLASLt's: over
    its bucket's fewest and most rows, and at neither slower) and repeats its bits, else cuBLAS;
    for gate/up, the cluster GEMM with the activation fused where it beats that choice plus the
    activation kernel (and cuBLAS's pair by `margin`). Entries of
    `base` (an earlier table) stay where this run measured no such (N, K, M); a bucket it
    measured is replaced whole."""
    measured: dict[tuple, dict] = {}
    # the fused gate/up + activation last: it competes with the GEMM chosen before it plus the
    # activation kernel (its "cublas_us" is cuBLAS's GEMM and that kernel, timed as a pair)
    for r in sorted(results, key=lambda r: r["impl"] == "sm90-glu-best"):
        if r["impl"] not in BEST and not (r["impl"] == "cublas" and r.get("us") is not None):
            continue
        e = measured.setdefault((f"{r['N']},{r['K']}", r["M"]), {
            "max_m": r["M"], "backend": "cublas", "config": None,
            "cublas_us": round(r.get("cublas_us", r["us"]), 2)})
        if r["impl"] == "cublas":
            continue
        backend = BEST[r["impl"]]
        e[f"{backend}_us"] = round(r["us"], 2)
        if "probes" in r:  # timed across its bucket too: {rows: {us, cublas_us}}
            e[f"{backend}_probes"] = {str(m): {k: round(v, 2) for k, v in p.items()}
                                      for m, p in r["probes"].items()}
        wins = r["speedup_vs_cublas"] >= 1 + margin and r.get("deterministic", True)
        chosen_us = e["cublas_us"] if e["config"] is None else e[f"{e['backend']}_us"]
        if backend == "sm90-glu":
            e["activation_us"] = round(r["cublas_us"] - e["cublas_us"], 2)
            chosen_us += e["activation_us"]
        if wins and r["us"] < chosen_us:
            e["backend"], e["config"] = backend, r["config"]
    shapes: dict[str, list] = {k: list(v) for k, v in (base or {}).get("shapes", {}).items()}
    for (key, m), entry in measured.items():
        kept = [e for e in shapes.get(key, []) if e["max_m"] != m]
        shapes[key] = kept + [entry]
    for entries in shapes.values():
        entries.sort(key=lambda e: e["max_m"])
    out = {"device": device, "dtype": dtype, "shapes": shapes}
    if any(e["backend"] == "cublaslt" for e in measured.values()):  # this run's cuBLASLt
        out["cublaslt_version"] = cublaslt.version()
    elif any(e["backend"] == "cublaslt" for entries in shapes.values() for e in entries):
        out["cublaslt_version"] = base.get("cublaslt_version")  # only the earlier table's entries
    return out


def print_rows(results: list[dict]) -> None:
    print(f"{'model':<14}{'op':<9}{'M':>5}{'N':>7}{'K':>7}  {'impl':<15}{'us':>8}{'TFLOP/s':>9}"
          f"{'GB/s':>7}{'roof%':>7}  config (block_m/n/k/split_k/warps/stages)")
    for r in results:
        if (r["impl"] in ("triton", "sm90", "sm90-glu", "cublaslt-algo") and not r.get("error")
                and not r.get("wrong")):
            continue  # the sweeps: in the JSON
        cfg = r.get("config")
        cfg = "/".join(str(v) for v in cfg.values()) if cfg else ""
        extra = f"  x{r['speedup_vs_cublas']:.2f} vs cuBLAS" if "speedup_vs_cublas" in r else ""
        extra += f"  WRONG (max err {r['max_abs_err']:.3g})" if r.get("wrong") else ""
        extra += "  NOT DETERMINISTIC" if r.get("deterministic") is False else ""
        if r.get("error"):
            print(f"{r['model']:<14}{r['op']:<9}{r['M']:>5}{r['N']:>7}{r['K']:>7}  {r['impl']:<15}"
                  f"  {cfg}  {r['error']}")
            continue
        print(f"{r['model']:<14}{r['op']:<9}{r['M']:>5}{r['N']:>7}{r['K']:>7}  {r['impl']:<15}"
              f"{r['us']:>8.1f}{r['TFLOP/s']:>9.0f}{r['GB/s']:>7.0f}{r['roofline%']:>7.0f}  {cfg}{extra}")


def step_savings(results: list[dict]) -> dict:
    """Per model and M: ms per decode step saved if every GEMM ran its best (Triton, cuBLASLt or
    cuBLAS)."""
    out: dict = {}
    best: dict[tuple, tuple] = {}  # (model, M, op) -> (layers, cuBLAS us, best us)
    for r in results:
        if r["impl"] not in BEST or r["impl"] == "sm90-glu-best":  # (GEMMs only)
            continue
        cublas = r["cublas_us"]
        k = (r["model"], r["M"], r["op"])
        best[k] = (r["layers"], cublas, min(cublas, r["us"], best.get(k, (0, 0, cublas))[2]))
    for (model, m, _), (layers, cublas, fastest) in best.items():
        s = out.setdefault(f"{model}@{m}", {"cublas_ms": 0.0, "best_ms": 0.0})
        s["cublas_ms"] += layers * cublas / 1e3
        s["best_ms"] += layers * fastest / 1e3
    for s in out.values():
        s["saved_ms"] = s["cublas_ms"] - s["best_ms"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["qwen2.5-1.5b", "qwen2.5-7b"],
                   help="preset names, model directories, .gguf files or cached hub ids")
    p.add_argument("--ops", nargs="+", default=["qkv", "o", "gate_up", "down"])
    p.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--stages", type=int, nargs="+", default=[3, 4])
    p.add_argument("--quick", action="store_true", help="4 tiles instead of 10")
    p.add_argument("--skip", nargs="*", default=[],
                   help="any of cublaslt (torch's cuBLASLt backend), cublaslt-algos (cuBLASLt's "
                   "other heuristic algorithms), tunableop, triton (the Triton sweep), sm90 (the "
                   "Hopper cluster GEMM's sweep)")
    p.add_argument("--hbm", type=float, default=4.8e12, help="HBM bytes/s (H200 spec: 4.8e12)")
    p.add_argument("--flops", type=float, default=791e12, help="dense bf16 FLOP/s (H200: 791e12)")
    p.add_argument("--margin", type=float, default=0.03,
                   help="Triton enters the table where it beats cuBLAS by this fraction")
    p.add_argument("--table-out", help="write the per-shape decode GEMM table (JSON) here")
    p.add_argument("--table-merge", help="an earlier table (JSON): its entries for the shapes and "
                   "buckets this run does not measure go into --table-out unchanged (one it "
                   "measures is replaced whole: with --skip triton, Triton's entry there goes)")
    args = p.parse_args()

    dtype = getattr(torch, args.dtype)
    props = torch.cuda.get_device_properties(0)
    base = None
    if args.table_merge:
        with open(args.table_merge) as f:
            base = json.load(f)
    if "sm90" not in args.skip and sm90_gemm.device_supported(torch.device("cuda")):
        variants = []
        for model in args.models:
            for shape in decode_shapes(model):
                if shape["op"] in args.ops and sm90_gemm.unsupported(shape["N"], shape["K"], dtype) is None:
                    for M in args.rows:
                        sweeps = sm90_sweeps(shape, M, props.multi_processor_count, args.quick)
                        variants += [(c, dtype, shape["bias"], glu)
                                     for glu, configs in sweeps.items() for c in configs]
        print(f"cluster GEMM: {sm90_gemm.precompile(variants)} kernels compiled", flush=True)
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            for shape in decode_shapes(model):
                if shape["op"] in args.ops:
                    results += study_shape(shape, sorted(args.rows), args, dtype,
                                           props.multi_processor_count, props.L2_cache_size, tmp, base)
    print(f"{props.name}  {args.dtype}  roofline: {args.hbm:.2e} B/s, {args.flops:.3g} FLOP/s;"
          "  timed in CUDA graphs, weights rotated past L2")
    print_rows(results)
    savings = step_savings(results)
    for key, s in savings.items():
        print(f"{key}: GEMMs {s['cublas_ms']:.3f} ms/step with cuBLAS, {s['best_ms']:.3f} with the "
              f"best of each shape (saves {s['saved_ms']:.3f} ms)")
    table = make_table(results, props.name, args.dtype, args.margin, base)
    if args.table_out:
        with open(args.table_out, "w") as f:
            json.dump(table, f, indent=1)
        print(f"table -> {args.table_out}")
    print(json.dumps({"args": vars(args), "device": props.name, "step_savings": savings,
                      "table": table, "results": results}))


if __name__ == "__main__":
    main()
