"""The default `tandem train grpo` on a GPU: the embedded SmolLM2-135M-Instruct in bf16, 60 steps
of 64-completion micro-batches at lr 1e-5, two seeds, with batch-invariant kernels (the GPU demo's
default) and with the default kernels. No run may take a non-finite step; the batch-invariant runs
must learn (held-out accuracy +20 points) with the engine and the trainer agreeing exactly (mean
|dlogp| <= 0.005; it is 0); the default kernels learn too, to bf16's kernel floor of agreement
(H200, 2026-12-01: mean |dlogp| 0.012-0.013). A fifth run trains padding-free with each prompt
packed once (`--padding-free`: shared prompts on), held to the default kernels' checks.

The five runs share the GPU at once (each engine takes an eighth of its memory): they are small, and
a run's numbers do not depend on its neighbours, only its step times do."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

SEEDS = (42, 1)


RUNS = [(seed, invariant, []) for seed in SEEDS for invariant in (True, False)] + [
    (SEEDS[0], False, ["--padding-free"])]


def test_default_grpo_run_learns_in_bf16(tmp_path):
    runs = {}
    for seed, invariant, extra in RUNS:
        out = tmp_path / f"run-{seed}-{invariant}{''.join(extra)}"
        flag = "--batch-invariant" if invariant else "--no-batch-invariant"
        cmd = [sys.executable, "-m", "tandem.cli", "train", "grpo", "--seed", str(seed), flag, *extra,
               "--vllm-gpu-memory-utilization", "0.12", "--output-dir", str(out), "--report-to", "jsonl"]
        runs[seed, invariant, " ".join(extra)] = (out, subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                                                        stderr=subprocess.PIPE, text=True))
    failures = []
    for (seed, invariant, extra), (out, proc) in runs.items():
        name = f"seed {seed} batch_invariant={invariant}{' ' + extra if extra else ''}"
        stdout, stderr = proc.communicate(timeout=1200)
        if proc.returncode != 0:
            failures.append(f"{name} exited {proc.returncode}: {stderr[-3000:]}")
            continue
        summary = json.loads(stdout.strip().splitlines()[-1])
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        before = summary["held_out_before"]["eval/accuracy_reward/mean"]
        after = summary["held_out_after"]["eval/accuracy_reward/mean"]
        dlogp = [r["sampling/sampling_logp_difference/mean"] for r in rows]
        mean_dlogp = sum(dlogp) / len(dlogp)
        print(f"{name}: held-out {before:.3f} -> {after:.3f}, "
              f"mean |dlogp| {mean_dlogp:.4f}, step {sum(r['time/step'] for r in rows[1:]) / (len(rows) - 1):.2f} s"
              f" ({len(RUNS)} runs sharing the GPU)")
        checks = {
            "60 steps": len(rows) == 60,
            "finite every step": all(r["grad_norm"] is not None for r in rows)
            and rows[-1]["train/nonfinite_steps"] == 0,
            "held-out gain": after - before >= (0.20 if invariant else 0.15),
            "mean |dlogp|": mean_dlogp <= (0.005 if invariant else 0.02),
            "reward curve": (out / "reward_curve.png").stat().st_size > 10_000,
        }
        if extra:
            checks["prompts shared"] = all(r["train/computed_tokens"] < r["train/tokens"] for r in rows)
        failures += [f"{name}: {check} ({before:.3f} -> {after:.3f}, |dlogp| {mean_dlogp:.4f})"
                     for check, ok in checks.items() if not ok]
    assert not failures, "\n".join(failures)
