"""`tandem bench rl --compare colocate,server` on a CPU: 2 gloo ranks, then a `tandem serve`
subprocess and a server-mode trainer, with a tiny model; the report has both modes."""

from __future__ import annotations

import json

import pytest
from model_fixtures import make_tiny_model

from tandem.bench.report import check_report
from tandem.bench.rl import RLBenchConfig, add_parser, run
from tandem.bench.rl_modes import PHASES


@pytest.mark.slow
def test_colocate_vs_server_on_cpu(tmp_path, capsys):
    model_dir = tmp_path / "tiny"
    make_tiny_model("llama").save_pretrained(model_dir)
    cfg = RLBenchConfig(model=str(model_dir), compare="colocate,server", device="cpu", num_prompts=2,
                        num_generations=2, prompt_len=6, completion_len=4, micro_batch=2, steps=1,
                        cpu_kv_cache_space_gib=0.01, output=str(tmp_path / "report.json"), print_json=True)
    run(cfg)
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # the closing JSON line
    report = json.loads((tmp_path / "report.json").read_text())
    check_report(report)
    assert line["results"].keys() == report["results"].keys()
    results = report["results"]
    for mode, world in (("colocate", 2), ("server", 1)):
        r = results[mode]
        assert r["vllm_mode"] == mode and r["world_size"] == world
        assert len(r["step_s"]) == 1 and r["step_s_median"] > 0
        assert 0 < r["completion_tokens_per_step"] <= 2 * 2 * 4  # the global batch, both modes
        assert r["completion_tokens_per_s_per_gpu"] == pytest.approx(r["completion_tokens_per_s"] / 2)
        assert set(r["breakdown_s"]) == set(PHASES) and all(v >= 0 for v in r["breakdown_s"].values())
        b = r["breakdown_s"]  # (plain reward functions score inside the train phase)
        assert b["weight_sync"] + b["generate"] + b["train"] <= r["step_s_median"] * 1.01
        assert b["reward"] <= b["train"]
        assert r["gpu"]["available"] is False and r["gpu_busy_frac"] == []
    assert results["colocate_over_server"] == pytest.approx(
        results["colocate"]["completion_tokens_per_s"] / results["server"]["completion_tokens_per_s"])


def test_bad_compare_lists_are_refused():
    with pytest.raises(ValueError, match="only with each other"):
        run(RLBenchConfig(compare="colocate,trl", device="cpu"))
    with pytest.raises(ValueError, match="split evenly"):
        run(RLBenchConfig(compare="colocate,server", device="cpu", num_prompts=3))


def test_cli_defaults_come_from_the_dataclass():
    import argparse

    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers())
    a = p.parse_args(["rl", "--compare", "colocate,server", "--fsdp"])
    assert a.device == RLBenchConfig.device and a.fsdp is True and a.compare == "colocate,server"
    assert a.server_gpu_memory_utilization == RLBenchConfig.server_gpu_memory_utilization


def test_cpu_gets_the_small_workload_unless_told_otherwise(monkeypatch):
    from tandem import cli
    from tandem.bench import rl
    from tandem.bench.rl_workload import CPU_SIZES

    seen = []
    monkeypatch.setattr(rl, "run", seen.append)
    assert cli.main(["bench", "rl", "--compare", "colocate,server", "--device", "cpu",
                     "--steps", "1"]) == 0
    assert seen[0].model == CPU_SIZES["model"] and seen[0].num_prompts == CPU_SIZES["num_prompts"]
    assert seen[0].steps == 1  # a flag given wins
    assert cli.main(["bench", "rl"]) == 0
    assert (seen[1].model, seen[1].num_prompts) == (RLBenchConfig.model, RLBenchConfig.num_prompts)
