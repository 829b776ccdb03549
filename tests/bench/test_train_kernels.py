"""`python -m tandem.bench.train_kernels` runs end to end (CPU: Triton interpreter, tiny shapes)
and ends with its JSON line; the timings themselves are the GPU's business."""

import importlib.util
import json
import os

import pytest

from tandem.bench import train_kernels

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None
                                or os.environ.get("TRITON_INTERPRET") != "1", reason="needs triton's interpreter")


def test_smoke_on_cpu(capsys):
    assert train_kernels.main(["--device", "cpu", "--rows", "2", "--seq", "5", "--hidden", "48",
                               "--intermediate", "80", "--heads", "4", "--kv-heads", "2", "--head-dim", "12",
                               "--reps", "1", "--warmup", "0"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["bench"] == "train_kernels"
    results = report["results"]
    assert set(results) == {"rmsnorm", "swiglu", "rotary", "layer"}, results
    for r in results.values():
        assert r["hf_ms"] > 0 and r["fused_ms"] > 0
    assert results["layer"]["max_rel_grad_diff"] < 0.1  # bf16 autocast in the interpreter: loose
    assert results["layer"]["fused_linear_ms"] > 0 and results["layer"]["fused_linear_max_rel_grad_diff"] < 0.1


def test_head_smoke_on_cpu(capsys):
    assert train_kernels.main(["--device", "cpu", "--rows", "2", "--completion", "5", "--hidden", "48",
                               "--vocab", "1000", "--head", "--skip-layer", "--reps", "1", "--warmup", "0"]) == 0
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["results"]
    head = results["head"]
    assert head["hf_ms"] > 0 and head["fused_ms"] > 0 and head["tokens"] == 10
    assert head["max_rel_diff"] < 0.05  # bf16 logit gradients, truncated in the interpreter
