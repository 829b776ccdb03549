"""The client's own cost, measured against the instantly streaming stub (in a child process)."""

from tandem.bench.client_overhead import OverheadConfig, run_client_overhead


def test_client_overhead_reports_ceiling_and_floor():
    report = run_client_overhead(
        OverheadConfig(num_prompts=100, input_len=4, output_len=16, max_concurrency=16),
        show_progress=False,
    )
    r = report["results"]
    assert report["kind"] == "client-overhead"
    assert r["completed"] == 100 + 50 and r["failed"] == 0  # loaded run, then one at a time
    assert r["client_ceiling_output_tok_s"] > 1000  # even a busy 2-core CI box
    assert 0 < r["client_cpu_us_per_token"] < 1000
    assert r["ttft_floor_ms"]["median"] < 100 and r["itl_floor_ms"]["median"] < 10
