"""Micro-benchmark of the trainer's fused kernels (`tandem.rl.fused_layers`) against HF's ops, one GPU.

    python -m tandem.bench.train_kernels [--rows 32 --seq 384 --hidden 1536 --intermediate 8960
        --heads 12 --kv-heads 2 --head-dim 128 --reps 20 --warmup 5] [--head --completion 256
        --vocab 151936]

Defaults are the grpo-1.5b train phase's micro-batch (Qwen2.5-1.5B, 32 rows x 384 tokens). Every
row times forward + backward under bf16 autocast over fp32 weights, as the trainer runs them, with
the casts autocast adds on HF's side (the fused side emits bf16 itself):
- rmsnorm: fp32 residual [T, D] -> norm -> the three bf16 casts of its q/k/v consumers;
- swiglu: bf16 gate, up [T, I] -> silu(gate) * up;
- rotary: bf16 q/k from the projections, fp32 cos/sin -> rotated q, k -> the attention's bf16 cast;
- layer: one whole Qwen2 decoder layer (SDPA, causal), patched vs unpatched, and the bytes it
  saves for backward; `fused_linear` adds the fused weight-gradient accumulation of its Linears
  (`tandem.rl.grad_accum_linear`). The layer's weight gradients accumulate over the reps, as over
  the micro-batches of an optimizer step.
- head (with --head): the fused log-prob head (`tandem.rl.logprobs.head_logprobs`) over
  --rows x --completion scored tokens (grpo-1.5b's micro-batch: 32 x 256) and a --vocab
  vocabulary, bf16 GEMMs over fp32 weights: its torch elementwise path (the HF column) vs its
  Triton kernels, around the same cuBLAS GEMMs.
Times are medians of --reps CUDA-event timings after --warmup runs; GB/s is the fused kernels'
own traffic (a lower bound of HF's). Prints a table, then one line of JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable

import torch

from tandem.bench.roofline import device_ceilings
from tandem.rl.fused_layers import patch_model, rms_norm, rotary_qk, silu_mul
from tandem.rl.grad_accum_linear import patch_model as patch_linears
from tandem.rl.logprobs import head_logprobs

BF16 = torch.bfloat16


def time_ms(fn: Callable[[], None], warmup: int, reps: int, cuda: bool = True) -> float:
    """Median milliseconds of fn() over `reps` CUDA-event timings, after `warmup` calls (on a CPU,
    the smoke test's, wall time)."""
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if not cuda:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _autocast(device: torch.device):
    return torch.autocast(device.type, dtype=BF16, cache_enabled=False)


def _fwd_bwd(forward: Callable[[], list[torch.Tensor]], grads: list[torch.Tensor], leaves: list[torch.Tensor],
             accumulate: bool = False):
    """fwd + bwd under autocast; with `accumulate` the gradients of leaves[1:] (the weights) are
    kept and summed into, as over an optimizer step's micro-batches."""
    def run():
        for t in leaves[:1] if accumulate else leaves:
            t.grad = None
        with _autocast(leaves[0].device):
            outs = forward()
        torch.autograd.backward(outs, [g.to(o.dtype) for o, g in zip(outs, grads)])
    return run


def _diff(a_run, b_run, outs_a, outs_b, leaves) -> float:
    """Max |fused - HF| over the outputs and the leaves' gradients, relative to HF's largest."""
    worst = 0.0
    results = []
    for run, outs in ((a_run, outs_a), (b_run, outs_b)):
        run()
        with _autocast(leaves[0].device):
            values = [o.detach().float() for o in outs()]
        results.append(values + [t.grad.float().clone() for t in leaves])
    for x, y in zip(*results):
        worst = max(worst, ((x - y).abs().max() / y.abs().max().clamp(min=1e-30)).item())
    return worst


def bench_ops(a, dev) -> dict:
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import (
        Qwen2RMSNorm,
        Qwen2RotaryEmbedding,
        apply_rotary_pos_emb,
    )

    B, L, D, inter, N, K, H = a.rows, a.seq, a.hidden, a.intermediate, a.heads, a.kv_heads, a.head_dim
    T = B * L
    out = {}
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape, dtype=torch.float32, grad=True):
        return torch.randn(*shape, generator=gen, device=dev).to(dtype).requires_grad_(grad)

    # rmsnorm, feeding three linears
    x, norm = randn(T, D), Qwen2RMSNorm(D, eps=1e-6).to(dev)
    grads = [torch.randn(T, D, generator=gen, device=dev).to(BF16) for _ in range(3)]

    def hf_norm():
        y = norm(x)  # fp32, as HF's
        return [y.to(BF16) for _ in range(3)]  # each of q/k/v casts it

    def fused_norm():
        return [rms_norm(x, norm.weight, 1e-6, BF16)] * 3

    out["rmsnorm"] = _op(a, hf_norm, fused_norm, grads, [x, norm.weight], bytes_=16 * T * D)

    # swiglu
    g, u = randn(T, inter, dtype=BF16), randn(T, inter, dtype=BF16)
    grads = [torch.randn(T, inter, generator=gen, device=dev).to(BF16)]
    out["swiglu"] = _op(a, lambda: [torch.nn.functional.silu(g) * u], lambda: [silu_mul(g, u)], grads, [g, u],
                        bytes_=16 * T * inter)

    # rotary, q and k
    rope = Qwen2RotaryEmbedding(Qwen2Config(hidden_size=N * H, num_attention_heads=N, head_dim=H,
                                            rope_theta=1e6, max_position_embeddings=4096)).to(dev)
    pos = torch.arange(L, device=dev).expand(B, L)
    cos, sin = rope(torch.zeros(1, device=dev), pos)  # fp32, as over fp32 weights
    q, k = randn(B, L, N, H, dtype=BF16), randn(B, L, K, H, dtype=BF16)
    grads = [torch.randn(B, N, L, H, generator=gen, device=dev).to(BF16),
             torch.randn(B, K, L, H, generator=gen, device=dev).to(BF16)]

    def hf_rope():
        qe, ke = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return [qe.to(BF16), ke.to(BF16)]

    out["rotary"] = _op(a, hf_rope, lambda: list(rotary_qk(q, k, cos, sin, BF16)), grads, [q, k],
                        bytes_=8 * T * (N + K) * H + 2 * 8 * T * H)
    return out


def _op(a, hf, fused, grads, leaves, bytes_: float) -> dict:
    hf_run, fused_run = _fwd_bwd(hf, grads, leaves), _fwd_bwd(fused, grads, leaves)
    cuda = a.device.startswith("cuda")
    row = {"hf_ms": time_ms(hf_run, a.warmup, a.reps, cuda), "fused_ms": time_ms(fused_run, a.warmup, a.reps, cuda)}
    row["speedup"] = row["hf_ms"] / row["fused_ms"]
    row["fused_gbs"] = bytes_ / row["fused_ms"] / 1e6
    row["max_rel_diff"] = _diff(fused_run, hf_run, fused, hf, leaves)
    return row


def bench_layer(a, dev) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=a.hidden, intermediate_size=a.intermediate, num_attention_heads=a.heads,
                      num_key_value_heads=a.kv_heads, head_dim=a.head_dim, num_hidden_layers=1, vocab_size=1024,
                      rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=4096,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    hf_model = Qwen2ForCausalLM(cfg).to(dev).train()
    fused_model = copy.deepcopy(hf_model)
    patch_model(fused_model)
    linear_model = copy.deepcopy(fused_model)
    patch_linears(linear_model)
    x = torch.randn(a.rows, a.seq, a.hidden, device=dev, requires_grad=True)
    pos = torch.arange(a.seq, device=dev).expand(a.rows, a.seq)
    cos, sin = hf_model.model.rotary_emb(x, pos)
    grad = [torch.randn_like(x)]

    def forward(model):
        layer = model.model.layers[0]

        def run():
            y = layer(x, attention_mask=None, position_ids=pos, position_embeddings=(cos, sin))
            return [y[0] if isinstance(y, tuple) else y]
        run.device = dev
        return run

    models = {"hf": hf_model, "fused": fused_model, "fused_linear": linear_model}
    leaves = {name: [x, *model.model.layers[0].parameters()] for name, model in models.items()}
    row = {}
    for name, model in models.items():
        run = _fwd_bwd(forward(model), grad, leaves[name], accumulate=True)
        row[f"{name}_ms"] = time_ms(run, a.warmup, a.reps, dev.type == "cuda")
        row[f"{name}_saved_mib"] = _saved_bytes(forward(model)) / 2**20
    row["speedup"] = row["hf_ms"] / row["fused_ms"]
    row["fused_linear_speedup"] = row["hf_ms"] / row["fused_linear_ms"]
    grads = {}
    for name, model in models.items():  # one fwd + bwd from zero gradients
        _fwd_bwd(forward(model), grad, leaves[name])()
        grads[name] = [t.grad.float().clone() for t in leaves[name]]
    for name, key in (("fused", "max_rel_grad_diff"), ("fused_linear", "fused_linear_max_rel_grad_diff")):
        row[key] = max(((f - h).norm() / h.norm().clamp(min=1e-30)).item() for f, h in zip(grads[name], grads["hf"]))
    return row


def bench_head(a, dev) -> dict:
    N, D, V = a.rows * a.completion, a.hidden, a.vocab
    gen = torch.Generator(device=dev).manual_seed(0)
    h_ND = torch.randn(N, D, generator=gen, device=dev, requires_grad=True)
    w_VD = (torch.randn(V, D, generator=gen, device=dev) / D**0.5).requires_grad_(True)
    target_N = torch.randint(0, V, (N,), generator=gen, device=dev)
    grad_N = torch.randn(N, generator=gen, device=dev)

    def step(kernels: bool):
        def run():
            h_ND.grad = w_VD.grad = None
            lp_N = head_logprobs(h_ND, w_VD, target_N, dtype=BF16, kernels=kernels)
            lp_N.backward(grad_N)
        return run

    cuda = dev.type == "cuda"
    row = {"hf_ms": time_ms(step(False), a.warmup, a.reps, cuda),
           "fused_ms": time_ms(step(True), a.warmup, a.reps, cuda)}
    row["speedup"] = row["hf_ms"] / row["fused_ms"]
    results = []
    for kernels in (True, False):
        step(kernels)()
        results.append([h_ND.grad.clone(), w_VD.grad.clone()])
    row["max_rel_diff"] = max(((x - y).abs().max() / y.abs().max().clamp(min=1e-30)).item()
                              for x, y in zip(*results))
    row["tokens"], row["vocab"] = N, V
    return row


def _saved_bytes(forward) -> int:
    """Bytes autograd keeps for backward in one forward (storage counted once, parameters left out)."""
    seen: dict[tuple[int, int], int] = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            s = t.untyped_storage()
            seen[(s.data_ptr(), s.nbytes())] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _autocast(forward.device):
        outs = forward()
    del outs
    return sum(seen.values())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--seq", type=int, default=384)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--intermediate", type=int, default=8960)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--skip-layer", action="store_true", help="only the single ops")
    p.add_argument("--head", action="store_true", help="also the fused log-prob head: torch vs kernels")
    p.add_argument("--completion", type=int, default=256, help="scored tokens a row, for --head")
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary, for --head")
    p.add_argument("--device", default="cuda", help="cuda; cpu only for the smoke test (TRITON_INTERPRET=1)")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("tandem.bench.train_kernels needs a CUDA GPU")
    results: dict = {}
    for name, fn in (("ops", bench_ops), ("layer", bench_layer), ("head", bench_head)):
        if (name == "layer" and a.skip_layer) or (name == "head" and not a.head):
            continue
        try:
            got = fn(a, dev)
            results.update(got if name == "ops" else {name: got})
        except Exception as e:  # noqa: BLE001 - one failing part still reports the others
            results[name + "_error"] = f"{type(e).__name__}: {e}"
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    hbm = device_ceilings()[0] if dev.type == "cuda" else None
    print(f"{'op (fwd+bwd)':<14}{'HF ms':>9}{'fused ms':>10}{'speedup':>9}{'fused GB/s':>12}{'max rel diff':>14}")
    for name, r in results.items():
        if not isinstance(r, dict):
            print(f"{name}: {r}")
            continue
        gbs = r.get("fused_gbs")
        share = f" ({gbs * 1e9 / hbm:.0%})" if gbs and hbm else ""
        diff = r.get("max_rel_diff", r.get("max_rel_grad_diff"))
        print(f"{name:<14}{r['hf_ms']:>9.3f}{r['fused_ms']:>10.3f}{r['speedup']:>8.2f}x"
              f"{(f'{gbs:.0f}' + share) if gbs else '':>12}{diff:>14.2e}")
    if isinstance(results.get("layer"), dict):
        r = results["layer"]
        print(f"layer saved for backward: HF {r['hf_saved_mib']:.0f} MiB, fused {r['fused_saved_mib']:.0f} MiB")
        print(f"layer + fused weight-gradient accumulation: {r['fused_linear_ms']:.3f} ms "
              f"({r['fused_linear_speedup']:.2f}x HF's), saved {r['fused_linear_saved_mib']:.0f} MiB, "
              f"max rel grad diff {r['fused_linear_max_rel_grad_diff']:.2e}")
    shapes = {k: getattr(a, k) for k in ("rows", "seq", "hidden", "intermediate", "heads", "kv_heads", "head_dim")}
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(json.dumps({"bench": "train_kernels", "device": name, "shapes": shapes,
                      "reps": a.reps, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
