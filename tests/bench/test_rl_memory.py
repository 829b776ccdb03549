"""`tandem bench rl --plan-only`: the trainer's memory plan for 7B and 14B architectures, from their
configs on the meta device, in a process that never holds the model (its peak RSS says so)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap


def test_plan_only_sizes_7b_and_14b_without_allocating_them():
    script = textwrap.dedent("""
        from tandem.cli import main
        for model in ("qwen2.5-7b", "qwen2.5-14b"):
            main(["bench", "rl", "--plan-only", "--model", model, "--num-prompts", "16",
                  "--num-generations", "8", "--memory-budget-gib", "139.8"])
        print("peak_kib", next(line.split()[1] for line in open("/proc/self/status")
                               if line.startswith("VmHWM:")))
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True
    ).stdout
    # its own address space's peak (VmHWM, KiB): ru_maxrss is not it, RUSAGE_CHILDREN being the
    # largest child this test process ever waited for and the child's RUSAGE_SELF starting from
    # the forking process's size (Linux keeps the pre-exec peak)
    peak_gib = int(out.rsplit("peak_kib ", 1)[1].split()[0]) / 2**20
    assert peak_gib < 3, (
        f"the plan-only process peaked at {peak_gib:.1f} GiB"
    )  # a 7B in fp32 is 28 GiB
    seven, fourteen = (json.loads(line) for line in out.splitlines() if line.startswith("{"))
    assert "memory plan (qwen2.5-7b)" in out and seven["fits"] and seven["recompute"]
    assert seven["params"] == 7_615_616_512 and seven["optim"] == "adamw_torch_fused"
    assert 100 < seven["plan_train_gib"] < seven["usable_gib"]
    assert not fourteen["fits"] and fourteen["params"] == 14_770_033_664
    assert "smallest change that fits" in out or "nothing tried fits" in out
