"""`bench serve --num-runs`: the same load N times, each with its own prompts, and its spread."""

import json
import statistics

import pytest

from tandem.bench.cli import main
from tandem.bench.serve import ServeConfig
from tandem.bench.serve_runs import run_series, summarize_runs

from .conftest import quick_config


def test_runs_draw_their_own_prompts_after_one_warm_up(stub):
    with stub(tpot_ms=1) as server:
        cfg = quick_config(server.base_url, num_prompts=12, output_len=4, num_warmups=1,
                           num_runs=3)
        cfg.dataset.seed = 5
        report = run_series(cfg, show_progress=False)
        prompts = [p["prompt"] for p in server.payloads]
    assert len(prompts) == 1 + 3 * 12 and prompts[0].startswith("Warm-up. ")
    measured = prompts[1:]
    runs = [set(measured[i * 12:(i + 1) * 12]) for i in range(3)]
    assert not (runs[0] & runs[1] or runs[0] & runs[2] or runs[1] & runs[2])  # no cache carry-over
    series = report["results"]["runs"]
    assert [r["seed"] for r in series["per_run"]] == [5, 6, 7]
    assert report["config"]["num_runs"] == 3 and report["config"]["dataset"]["seed"] == 5
    assert all(r["completed"] == 12 and r["failed"] == 0 for r in series["per_run"])
    throughputs = [r["output_throughput"] for r in series["per_run"]]
    assert report["results"]["output_throughput"] == statistics.median(throughputs)
    assert throughputs[series["reported_run"] - 1] == statistics.median(throughputs)
    assert series["stats"]["output_throughput"]["min"] == min(throughputs)


def test_the_summary_of_runs():
    def run(seed, tput, ttft):
        dist = {"median": ttft, "p99": ttft * 2}
        return {"config": {"dataset": {"seed": seed}},
                "results": {"completed": 4, "failed": 0, "output_throughput": tput,
                            "request_throughput": tput / 100, "duration_s": 1.0,
                            "ttft_ms": dist, "tpot_ms": {"median": None}, "itl_ms": dist,
                            "e2el_ms": dist}}

    reports = [run(0, 100.0, 10.0), run(1, 300.0, 30.0), run(2, 200.0, 20.0), run(3, 400.0, 40.0)]
    s = summarize_runs(reports, median_run=2)
    assert (s["num_runs"], s["reported_run"]) == (4, 3)
    tput = s["stats"]["output_throughput"]
    assert (tput["median"], tput["mean"], tput["min"], tput["max"]) == (250.0, 250.0, 100.0, 400.0)
    assert tput["cv"] == pytest.approx(statistics.stdev([100, 300, 200, 400]) / 250)
    assert s["stats"]["p99_ttft_ms"]["median"] == 50.0
    assert "median_tpot_ms" not in s["stats"]  # no run had one
    assert s["stats"]["duration_s"]["cv"] == 0.0


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_num_runs_is_checked(bad):
    with pytest.raises(ValueError, match="num_runs"):
        ServeConfig(num_runs=bad)


def test_cli_prints_the_runs_table_and_keeps_them_in_the_json_line(stub, capsys):
    with stub(tpot_ms=1) as server:
        code = main(["serve", "--base-url", server.base_url, "--num-prompts", "6",
                     "--input-len", "8", "--output-len", "3", "--num-runs", "2", "--seed", "3",
                     "--json"])
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "2 runs (the tables above: run" in "\n".join(lines[:-1])
    runs = json.loads(lines[-1])["results"]["runs"]
    assert [r["seed"] for r in runs["per_run"]] == [3, 4]


def failing_at(monkeypatch, run_number):
    """run_series' runs fail from `run_number` on (the server gone)."""
    from tandem.bench import serve_runs

    real, calls = serve_runs.run_benchmark, []

    def run(cfg, show_progress=True):
        calls.append(cfg.dataset.seed)
        if len(calls) >= run_number:
            raise RuntimeError("warm-up request to the server failed")
        return real(cfg, show_progress)

    monkeypatch.setattr(serve_runs, "run_benchmark", run)


def test_a_series_cut_short_keeps_the_runs_done(stub, monkeypatch):
    failing_at(monkeypatch, 3)
    with stub(tpot_ms=1) as server:
        report = run_series(quick_config(server.base_url, num_prompts=4, output_len=2,
                                         num_runs=4), show_progress=False)
    runs = report["results"]["runs"]
    assert runs["num_runs"] == 2 and [r["seed"] for r in runs["per_run"]] == [0, 1]
    assert runs["error"].startswith("run 3 of 4: RuntimeError: warm-up")


def test_a_series_whose_first_run_fails_raises(stub, monkeypatch):
    failing_at(monkeypatch, 1)
    with stub(tpot_ms=1) as server, pytest.raises(RuntimeError, match="warm-up"):
        run_series(quick_config(server.base_url, num_prompts=4, num_runs=3), show_progress=False)
