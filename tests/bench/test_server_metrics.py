"""`bench serve`'s server section: the server's Prometheus counters before and after the load, read
from tandem's own /metrics text and from vLLM's names; a server without them gives no section."""

from __future__ import annotations

import threading
import time

import pytest

from tandem.bench.client import TargetConfig
from tandem.bench.serve import print_report, run_benchmark
from tandem.bench.server_metrics import (
    QueueSampler,
    over_run,
    parse_prometheus,
    queue_rows,
    scrape,
    server_rows,
)
from tandem.engine.metrics import EngineStats, ServerMetrics

from .conftest import quick_config

VLLM_TEXT = """\
# HELP vllm:iteration_tokens_total Histogram of number of tokens per engine_step.
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_sum{{model_name="m"}} {sum}
vllm:iteration_tokens_total_bucket{{le="1.0",model_name="m"}} 3.0
vllm:iteration_tokens_total_count{{model_name="m"}} {count}
vllm:generation_tokens_total{{model_name="m"}} {gen}
vllm:num_preemptions_total{{model_name="m"}} {pre}
vllm:prefix_cache_queries_total{{model_name="m"}} {q}
vllm:prefix_cache_hits_total{{model_name="m"}} {h}
vllm:num_requests_running{{model_name="m"}} 7.0
"""


def _tandem_text(stats: EngineStats) -> str:
    return ServerMetrics().render(stats, "model-a")


def test_tandem_counters_over_a_run():
    """Deltas of tandem's own rendering: steps and host ms by kind, tokens a step, preemptions,
    the prefix cache's hit rate over the run (not since start)."""
    before = EngineStats(generation_tokens=100, num_preemptions=1, prefix_queries=1000,
                         prefix_hits=500, step_stats={"decode": (10, 0.02),
                                                      "prefill_or_mixed": (2, 0.01)})
    after = EngineStats(generation_tokens=1100, num_preemptions=4, prefix_queries=3000,
                        prefix_hits=1000, step_stats={"decode": (60, 0.14),
                                                      "prefill_or_mixed": (6, 0.05)})
    run = over_run(parse_prometheus(_tandem_text(before)), parse_prometheus(_tandem_text(after)))
    assert run["source"] == "tandem"
    assert run["steps_by_kind"]["decode"]["steps"] == 50
    assert run["steps_by_kind"]["decode"]["mean_ms"] == pytest.approx(2.4)
    assert run["steps_by_kind"]["prefill_or_mixed"] == {"steps": 4, "mean_ms": pytest.approx(10.0)}
    assert run["engine_steps"] == 54
    assert run["generation_tokens"] == 1000 and isinstance(run["generation_tokens"], int)
    assert run["generation_tokens_per_step"] == pytest.approx(1000 / 54)
    assert run["preemptions"] == 3 and isinstance(run["preemptions"], int)
    assert run["prefix_cache_hit_rate"] == pytest.approx(0.25)  # 500 of the run's 2000
    rows = dict(server_rows(run))
    assert rows["  decode: steps / mean host ms"] == "50 / 2.40"


def test_a_kind_first_seen_after_the_start_counts_from_zero():
    before = EngineStats(generation_tokens=0, step_stats={})
    after = EngineStats(generation_tokens=8, step_stats={"decode": (8, 0.008)})
    run = over_run(parse_prometheus(_tandem_text(before)), parse_prometheus(_tandem_text(after)))
    assert run["steps_by_kind"] == {"decode": {"steps": 8, "mean_ms": pytest.approx(1.0)}}
    assert run["generation_tokens_per_step"] == 1.0


def test_vllm_counters_over_a_run():
    before = parse_prometheus(VLLM_TEXT.format(sum=50.0, count=5.0, gen=40.0, pre=0.0, q=0.0, h=0.0))
    after = parse_prometheus(VLLM_TEXT.format(sum=2050.0, count=105.0, gen=1640.0, pre=2.0,
                                              q=400.0, h=100.0))
    run = over_run(before, after)
    assert run["source"] == "vllm"
    assert run["engine_steps"] == 100
    assert run["scheduled_tokens_per_step"] == pytest.approx(20.0)
    assert run["generation_tokens"] == 1600 and run["generation_tokens_per_step"] == 16.0
    assert run["preemptions"] == 2 and run["prefix_cache_hit_rate"] == pytest.approx(0.25)
    assert "steps_by_kind" not in run


def test_parse_sums_over_labels_but_kind_and_skips_what_it_cannot_read():
    text = ('a_total{model_name="x"} 1\na_total{model_name="y"} 2.5\n'
            'b_total{model_name="x",kind="decode"} 3\nb_total{kind="decode"} 4\n'
            "# a comment\n\nnot a sample line!\nc NaNa\nd 5 1700000000\n")
    got = parse_prometheus(text)
    assert got == {"a_total": 3.5, "b_total{kind=decode}": 7.0, "d": 5.0}


def test_no_known_counters_give_no_section():
    assert over_run(None, {"vllm:generation_tokens_total": 1.0}) is None
    assert over_run({"x": 1.0}, {"x": 2.0}) is None
    assert server_rows(None)[0][0] == "status"


def test_bench_serve_against_vllm_style_metrics(stub, capsys):
    """The stub counts a step for each prompt and for each token it streams, as vLLM's names
    say: the report's server section matches what the client received, the warm-up left out."""
    with stub(vllm_metrics=True) as server:
        report = run_benchmark(quick_config(server.base_url, num_prompts=12, output_len=5),
                               show_progress=False)
    res = report["results"]
    assert res["completed"] == 12 and res["total_output_tokens"] == 60
    run = res["server"]
    assert run["source"] == "vllm"
    assert run["generation_tokens"] == 60
    assert run["engine_steps"] == 12 + 60
    print_report(report)
    assert "Server (its /metrics over the run)" in capsys.readouterr().out


def test_bench_serve_against_a_server_without_metrics(stub, capsys):
    with stub() as server:
        assert scrape(TargetConfig(base_url=server.base_url)) is None  # a 404
        report = run_benchmark(quick_config(server.base_url, num_prompts=3, output_len=2),
                               show_progress=False)
    assert report["results"]["server"] is None
    print_report(report)
    assert "no /metrics with tandem's or vLLM's counters" in capsys.readouterr().out


def _sampler(samples: list[tuple[float, float, float, float | None]]) -> QueueSampler:
    """A sampler holding `samples` (time, running, waiting, KV use) as if it had taken them."""
    q = QueueSampler(TargetConfig(), enabled=False)
    q.prefix = "tandem:"
    q.times = [t for t, *_ in samples]
    q.delays = [0.0] * len(samples)  # answered at once
    q.rows = [tuple(r) for _, *r in samples]
    return q


def test_queue_states_say_what_held_the_batch_below_its_peak():
    """Client in flight 8 from t=0 to 10, then 2 until 12, then none. Each sample lands in one
    state: the batch at its peak (4), below it with requests waiting in the engine, below it
    with requests sent but not yet in the engine, or below it with nothing left to run."""
    timeline = [(0.0, 8), (10.0, 2), (12.0, 0)]
    q = _sampler([
        (-1.0, 0, 0, None),  # before the load: left out
        (1.0, 4, 4, 0.5),    # full
        (2.0, 4, 2, 0.5),    # full (2 more sent, not yet in the engine)
        (3.0, 3, 1, 0.4),    # below, 1 waiting in the engine
        (4.0, 2, 0, 0.3),    # below, 6 sent and not in the engine
        (11.0, 2, 0, 0.1),   # below, nothing else in flight: the drain
        (13.0, 0, 0, 0.0),   # nothing in flight: left out
    ])
    got = q.summary(timeline, window=(0.0, 20.0))
    assert got["samples"] == 5 and got["source"] == "tandem"
    assert got["running_peak"] == 4 and got["running_mean"] == pytest.approx(15 / 5)
    assert got["waiting_max"] == 4 and got["waiting_mean"] == pytest.approx(7 / 5)
    assert got["not_yet_in_engine_max"] == 6
    assert got["not_yet_in_engine_mean"] == pytest.approx((0 + 2 + 4 + 6 + 0) / 5)
    assert got["states"] == {"full": 0.4, "queued_in_engine": 0.2, "not_yet_in_engine": 0.2,
                             "nothing_to_run": 0.2}
    assert got["kv_cache_usage_max"] == 0.5
    # the series the report keeps and plots: the run's samples (t0 = 1.0 to 11.0), times from t0
    assert q.series(1.0, 11.0) == {"t": [0.0, 1.0, 2.0, 3.0, 10.0], "running": [4, 4, 3, 2, 2],
                                   "waiting": [4, 2, 1, 0, 0]}
    rows = dict(queue_rows(got))
    assert rows["running: mean / peak"] == "3.0 / 4"
    assert rows["  below it, requests not yet in the engine"] == 0.2
    # the window bounds the samples too
    assert q.summary(timeline, window=(0.0, 3.5))["samples"] == 3


def test_queue_sampler_without_gauges_or_samples():
    assert QueueSampler(TargetConfig(), enabled=False).summary([(0.0, 1)], (0.0, 1.0)) is None
    assert queue_rows(None)[0][0] == "status"
    empty = _sampler([]).summary([(0.0, 1)], (0.0, 1.0))
    assert empty["samples"] == 0 and queue_rows(empty) == [("samples", 0)]
    no_gauges = QueueSampler(TargetConfig(), scrape_fn=lambda: {"tandem:generation_tokens_total": 1.0})
    with no_gauges:
        assert no_gauges._thread is None  # nothing to sample: no thread
    assert no_gauges.summary([(0.0, 1)], (0.0, 1.0)) is None


def test_queue_sampler_polls_until_stopped():
    """The thread reads the gauges, by vLLM's names here, until the run ends."""
    calls, enough = [], threading.Event()

    def fake_scrape():
        calls.append(1)
        if len(calls) >= 4:
            enough.set()
        return {"vllm:num_requests_running": float(len(calls)), "vllm:num_requests_waiting": 1.0}

    q = QueueSampler(TargetConfig(), interval_s=0.001, scrape_fn=fake_scrape)
    with q:
        assert enough.wait(10.0)
    n = len(calls)
    assert q.prefix == "vllm:" and q._thread is None
    assert len(q.rows) == n - 1  # the first call only found the gauges
    assert [r[:2] for r in q.rows[:3]] == [(2.0, 1.0), (3.0, 1.0), (4.0, 1.0)]
    assert q.rows[0][2] is None  # no KV-cache gauge
    assert len(calls) == n  # stopped


def test_a_sample_is_timed_when_its_answer_came():
    """A server too busy to answer at once (an API server reading a burst): the sample carries
    the time its answer arrived, when the gauges were read, and how long the answer took; the
    summary and the report give the slowest answer."""
    calls, asked, release, answered = [], threading.Event(), threading.Event(), threading.Event()

    def slow_scrape():
        calls.append(1)
        if len(calls) == 2:  # the first sample's answer is held until the test lets it go
            asked.set()
            assert release.wait(10.0)
        if len(calls) >= 2:
            answered.set()
        return {"tandem:num_requests_running": 4.0, "tandem:num_requests_waiting": 0.0}

    q = QueueSampler(TargetConfig(), interval_s=60.0, scrape_fn=slow_scrape)
    with q:
        assert asked.wait(10.0)
        released_at = time.perf_counter()
        release.set()
        assert answered.wait(10.0)
        for _ in range(10_000):  # (appended right after the answer returns; a hang guard only)
            if q.times:
                break
            time.sleep(0.001)
    assert q.times[0] >= released_at  # timed at the answer, not at the asking
    assert q.delays[0] >= q.times[0] - released_at
    got = q.summary([(q.times[0] - 1.0, 8)], window=(q.times[0] - 1.0, q.times[0] + 1.0))
    assert got["samples"] == 1 and got["answer_delay_max_s"] == q.delays[0]
    rows = dict(queue_rows(got))
    assert rows["slowest /metrics answer (s; samples are timed at the answer)"] == q.delays[0]


def test_bench_serve_samples_the_queue(stub, capsys, tmp_path):
    """The stub runs 2 requests at a time and says the rest wait: the report's queue section
    never sees more than 2 running, and its states account for every sample."""
    with stub(vllm_metrics=True, capacity=2, tpot_ms=5.0) as server:
        cfg = quick_config(server.base_url, num_prompts=6, output_len=8, queue_interval_s=0.005,
                           output_dir=str(tmp_path))
        report = run_benchmark(cfg, show_progress=False)
    queue = report["results"]["server_queue"]
    assert queue["source"] == "vllm"
    if queue["samples"]:
        assert queue["running_peak"] <= 2
        assert sum(queue["states"].values()) == pytest.approx(1.0)
    assert (tmp_path / "timeline.png").stat().st_size > 1000  # with the queue's lines when sampled
    print_report(report)
    assert "Server queue (its /metrics while requests were in flight)" in capsys.readouterr().out
