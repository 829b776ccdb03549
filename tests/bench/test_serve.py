"""`bench serve` end to end against the stub server: failures shown, figures consistent."""

import json
import subprocess
import sys

import pytest

from tandem.bench import report as rp
from tandem.bench.cli import main
from tandem.bench.load import LoadConfig
from tandem.bench.serve import run_benchmark

from .conftest import quick_config


def test_run_with_failures_is_consistent(stub):
    with stub(ttft_ms=5, tpot_ms=2, fail_every=5, error_every=7) as server:
        cfg = quick_config(
            server.base_url,
            num_prompts=30,
            output_len=6,
            num_warmups=1,
            slo="ttft=10000,tpot=10000",
        )
        report = run_benchmark(cfg, show_progress=False)
        assert server.count == 31  # one warm-up request first
        prompts = [p["prompt"] for p in server.payloads]
    assert prompts[0].startswith("Warm-up. ")  # not a measured prompt: no prefix-cache hit
    assert not any(p.startswith("Warm-up. ") for p in prompts[1:])
    rp.check_report(report)
    res = report["results"]
    ok_rows = [r for r in res["requests"] if r["ok"]]
    assert res["completed"] + res["failed"] == 30
    assert res["failed"] >= 6 and len(ok_rows) == res["completed"]
    assert {e["error"].split(":")[0] for e in res["errors"]} == {"HTTP 500", "stream error"}
    assert sum(e["count"] for e in res["errors"]) == res["failed"]
    # every figure agrees with the server's usage reports
    assert res["output_tokens_from_usage"]
    assert (
        res["total_output_tokens"] == sum(r["output_tokens"] for r in ok_rows) == 6 * len(ok_rows)
    )
    assert res["output_throughput"] == pytest.approx(res["total_output_tokens"] / res["duration_s"])
    assert res["good_requests"] == res["completed"]  # generous SLO: every success is good
    assert res["ttft_ms"]["min"] >= 5.0 and res["tpot_ms"]["min"] >= 1.5
    assert res["e2el_ms"]["max"] >= res["ttft_ms"]["max"]
    # the stub answers with headers at once and sleeps ttft_ms before the first token
    for row in ok_rows:
        assert 0.0 <= row["response_start_ms"] <= row["ttft_ms"]
    assert res["response_start_ms"]["max"] <= res["ttft_ms"]["max"]
    assert 0.0 < res["last_response_start_s"] <= res["duration_s"]
    assert 0.0 < res["first_response_start_s"] <= res["last_response_start_s"]
    assert res["first_response_start_s"] <= res["first_token_s"] <= res["duration_s"]
    assert res["client"]["processes"] == 1 and res["client"]["cpu_s"] > 0
    assert report["gpu"]["available"] in (True, False)


def test_poisson_rate_and_max_seconds(stub):
    with stub(tpot_ms=1) as server:
        load = LoadConfig(request_rate=40.0, max_seconds=0.5, seed=2)
        report = run_benchmark(
            quick_config(server.base_url, num_prompts=200, output_len=3, load=load, num_warmups=0),
            show_progress=False,
        )
    res = report["results"]
    # ~40/s for 0.5 s: about 20 sent, far fewer than the 200 prepared
    assert 5 <= res["completed"] <= 45 and res["failed"] == 0
    assert res["client"]["schedule_lag_ms"]["median"] < 50


def test_split_over_two_client_processes(stub):
    with stub(tpot_ms=2) as server:
        cfg = quick_config(
            server.base_url,
            num_prompts=24,
            output_len=4,
            num_warmups=0,
            num_client_processes=2,
            load=LoadConfig(max_concurrency=6),
        )
        report = run_benchmark(cfg, show_progress=False)
        assert server.max_in_flight <= 6
    res = report["results"]
    assert res["completed"] == 24 and res["total_output_tokens"] == 96
    assert res["client"]["processes"] == 2
    assert [r["index"] for r in res["requests"]] == list(range(24))
    # the start on CLOCK_MONOTONIC lines up the server's own clock with the per-request times:
    # every request came to the server between its send and its response's headers
    t0, rows = res["start_monotonic_s"], res["requests"]
    sent = [t0 + (r["schedule_lag_ms"] + r["queue_ms"]) / 1e3 for r in rows]
    answered = [s + r["response_start_ms"] / 1e3 for s, r in zip(sent, rows)]
    assert len(server.arrivals) == 24
    assert min(sent) <= min(server.arrivals) and max(server.arrivals) <= max(answered)


def test_a_burst_is_split_over_client_processes_by_default(stub, monkeypatch):
    """No --num-client-processes: a burst goes out from one process per share (the share made
    small here, and the machine given 8 cores, so a 24-request run splits in two)."""
    import tandem.bench.load as load_mod
    import tandem.bench.serve as serve_mod

    monkeypatch.setattr(load_mod, "REQUESTS_PER_CLIENT_PROCESS", 12)
    monkeypatch.setattr(serve_mod.os, "sched_getaffinity", lambda _pid: set(range(8)), raising=False)
    with stub(tpot_ms=2) as server:
        cfg = quick_config(server.base_url, num_prompts=24, output_len=4, num_warmups=0)
        assert cfg.num_client_processes is None and cfg.client_processes() == 2
        report = run_benchmark(cfg, show_progress=False)
    res = report["results"]
    assert res["completed"] == 24 and res["client"]["processes"] == 2
    assert [r["index"] for r in res["requests"]] == list(range(24))


def test_a_client_process_does_not_import_torch():
    """A spawned client process imports `tandem.bench.serve` for its target: with torch behind
    it each of them took seconds to start on a GPU host. `tandem`'s names load on first use."""
    code = ("import sys, tandem.bench.serve, tandem; assert 'torch' not in sys.modules; "
            "tandem.SamplingParams; assert 'torch' not in sys.modules; tandem.LLM; "
            "assert 'torch' in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
    import tandem

    assert sorted(tandem.__all__) == sorted(tandem._EXPORTS)  # the names listed twice agree


def test_cli_table_then_one_json_line(stub, tmp_path, capsys):
    out, out_dir = tmp_path / "serve.json", tmp_path / "run"
    with stub(tpot_ms=1) as server:
        code = main(
            [
                "serve",
                "--base-url",
                server.base_url,
                "--num-prompts",
                "8",
                "--input-len",
                "8",
                "--output-len",
                "4",
                "--endpoint",
                "chat",
                "--slo",
                "ttft=5000",
                "--output",
                str(out),
                "--json",
                "--output-dir",
                str(out_dir),
            ]
        )
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "Time to first token" in "\n".join(lines[:-1])
    last = json.loads(lines[-1])
    assert last["schema"] == "tandem.bench/1" and last["kind"] == "serve"
    assert "requests" not in last["results"]  # bulky lists only in the file
    saved = json.loads(out.read_text())
    assert len(saved["results"]["requests"]) == 8
    assert saved["config"]["target"]["endpoint"] == "/v1/chat/completions"
    assert (out_dir / "requests.csv").read_text().count("\n") == 9
    assert (out_dir / "timeline.png").stat().st_size > 1000


def test_cli_failed_warmup_exits_1_with_json_error(stub, capsys):
    with stub(fail_every=1) as server:
        code = main(
            ["serve", "--base-url", server.base_url, "--num-prompts", "3", "--output-len", "2",
             "--json"]
        )
    assert code == 1
    cap = capsys.readouterr()
    err = json.loads(cap.out.strip().splitlines()[-1])
    assert "warm-up" in err["error"] and "HTTP 500" in err["error"]
    assert "warm-up" in cap.err


def test_module_entry_point_self_test(tmp_path):
    """`python -m tandem.bench.cli serve --self-test`: against the built-in instant stub."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem.bench.cli",
            "serve",
            "--self-test",
            "--num-prompts",
            "40",
            "--input-len",
            "8",
            "--output-len",
            "16",
            "--max-concurrency",
            "8",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["results"]["completed"] == 40 and last["results"]["total_output_tokens"] == 640


def test_with_a_fake_gpu_the_monitor_reports_idle_while_busy(stub, monkeypatch, tmp_path, capsys):
    from tandem.bench import serve
    from tandem.bench.gpu_monitor import GpuMonitor

    from .test_gpu_monitor import ScriptedBackend

    def fake_monitor(interval_s, indices, enabled):
        return GpuMonitor(0.01, backend=ScriptedBackend([3.0] * 10_000))  # an idle GPU

    monkeypatch.setattr(serve, "GpuMonitor", fake_monitor)
    with stub(tpot_ms=10) as server:
        cfg = quick_config(
            server.base_url, num_prompts=6, output_len=10, num_warmups=0, output_dir=str(tmp_path)
        )
        report = serve.run_benchmark(cfg, show_progress=False)
    gpu, idle = report["gpu"], report["results"]["gpu_idle_while_busy"]
    assert gpu["available"] and gpu["devices"][0]["util_mean"] == 3.0
    assert len(gpu["samples"]["t"]) >= 5
    assert idle["busy_samples"] >= 5 and idle["idle_while_busy_frac"] == 1.0
    serve.print_report(report)
    assert "GPU was idle" in capsys.readouterr().out
    assert (tmp_path / "timeline.png").stat().st_size > 1000


def test_a_peer_server_without_done(stub):
    """What `tandem bench serve` sees from `transformers serve`: no [DONE], finish + usage."""
    with stub(tpot_ms=1, send_done=False) as server:
        report = run_benchmark(quick_config(server.base_url, num_prompts=8, output_len=4),
                               show_progress=False)
    assert report["results"]["completed"] == 8 and report["results"]["failed"] == 0


def test_warmup_refused_for_ignore_eos_suggests_no_ignore_eos(stub):
    with stub(reject_fields=("ignore_eos", "min_tokens")) as server:
        with pytest.raises(RuntimeError, match="--no-ignore-eos"):
            run_benchmark(quick_config(server.base_url, num_prompts=2), show_progress=False)


def test_workload_checked_against_max_model_len_before_sending(stub):
    with stub(max_model_len=20) as server:
        cfg = quick_config(server.base_url, num_prompts=4, input_len=16, output_len=8)
        with pytest.raises(RuntimeError, match=r"4 of 4 requests do not fit .*max_model_len \(20\)"):
            run_benchmark(cfg, show_progress=False)
        assert server.count == 0  # nothing was sent
        fits = quick_config(server.base_url, num_prompts=4, input_len=8, output_len=8)
        assert run_benchmark(fits, show_progress=False)["results"]["completed"] == 4
