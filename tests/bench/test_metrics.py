"""Metric definitions against hand-built timelines (values computed by hand)."""

import pytest

from tandem.bench.metrics import (
    RequestRecord,
    distribution,
    e2e,
    inflight_timeline,
    itls,
    meets_slo,
    parse_slo,
    peak_output_rate,
    summarize,
    tpot,
    ttft,
)


def rec(index, start, times, tokens=None, ok=True, end=None, error="", prompt=10, expected=0):
    r = RequestRecord(index, prompt_len=prompt, expected_output_len=expected or len(times))
    r.t_start, r.token_times, r.ok, r.error = start, list(times), ok, error
    r.t_end = end if end is not None else (times[-1] if times else start)
    r.usage_completion_tokens = tokens
    return r


def test_ttft_tpot_itl_e2e_by_hand():
    r = rec(0, 1.0, [1.1, 1.15, 1.25, 1.3], tokens=4)
    assert ttft(r) == pytest.approx(0.1)
    assert e2e(r) == pytest.approx(0.3)
    assert tpot(r) == pytest.approx((0.3 - 0.1) / 3)  # (E2E - TTFT) / (n - 1)
    assert itls(r) == pytest.approx([0.05, 0.1, 0.05])


def test_tpot_uses_usage_tokens_not_chunks():
    # 2 chunks carried 5 tokens (e.g. speculative decoding): TPOT divides by 5 - 1
    r = rec(0, 0.0, [0.2, 0.6], tokens=5)
    assert tpot(r) == pytest.approx(0.4 / 4)
    assert r.output_tokens == 5
    r.usage_completion_tokens = None  # no usage: count chunks
    assert r.output_tokens == 2


def test_tpot_undefined_for_one_token():
    assert tpot(rec(0, 0.0, [0.5], tokens=1)) is None


def test_distribution_percentiles_linear_like_numpy():
    d = distribution([0.001, 0.002, 0.003, 0.004])  # seconds -> ms
    assert d["mean"] == pytest.approx(2.5)
    assert d["median"] == pytest.approx(2.5)
    assert d["p90"] == pytest.approx(3.7)
    assert d["p99"] == pytest.approx(3.97)
    assert d["min"] == pytest.approx(1.0) and d["max"] == pytest.approx(4.0)
    assert distribution([])["p99"] is None


def test_parse_slo():
    assert parse_slo("ttft=1000,tpot=50") == {"ttft": 1000.0, "tpot": 50.0}
    assert parse_slo("ttft:500 e2e:3000") == {"ttft": 500.0, "e2el": 3000.0}  # vLLM spelling
    assert parse_slo(None) == {}
    with pytest.raises(ValueError, match="bad SLO"):
        parse_slo("latency=5")
    with pytest.raises(ValueError, match="> 0"):
        parse_slo("ttft=0")


def test_goodput_counts_requests_meeting_every_slo():
    slo = {"ttft": 150.0, "tpot": 60.0}
    fast = rec(0, 0.0, [0.1, 0.15, 0.2], tokens=3)  # ttft 100, tpot 50
    slow_first = rec(1, 0.0, [0.2, 0.25, 0.3], tokens=3)  # ttft 200
    slow_decode = rec(2, 0.0, [0.1, 0.2, 0.3], tokens=3)  # tpot 100
    failed = rec(3, 0.0, [], ok=False, end=0.4, error="HTTP 500")
    assert [meets_slo(r, slo) for r in (fast, slow_first, slow_decode, failed)] == [
        True,
        False,
        False,
        False,
    ]
    s = summarize([fast, slow_first, slow_decode, failed], t0=0.0, slo=slo)
    assert s["good_requests"] == 1
    assert s["duration_s"] == pytest.approx(0.4)  # to the last response, failed ones included
    assert s["goodput"] == pytest.approx(1 / 0.4)


def test_summarize_throughputs_and_failures():
    a = rec(0, 0.0, [0.5, 1.0], tokens=2, prompt=10, expected=2)
    b = rec(1, 0.5, [1.5, 2.0], tokens=2, prompt=20, expected=4)
    c = rec(2, 1.0, [], ok=False, end=1.2, error="HTTP 500: boom")
    s = summarize([a, b, c], t0=0.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["duration_s"] == pytest.approx(2.0)
    assert s["total_output_tokens"] == 4
    assert s["total_input_tokens"] == 30
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(2.0)
    assert s["total_token_throughput"] == pytest.approx(17.0)
    assert s["short_outputs"] == 1  # b asked for 4, got 2
    assert s["errors"] == [{"error": "HTTP 500: boom", "count": 1}]
    assert s["goodput"] is None
    assert s["ttft_ms"]["mean"] == pytest.approx(750.0)
    assert s["response_start_ms"]["mean"] is None and s["last_response_start_s"] is None  # none seen
    assert s["first_response_start_s"] is None
    a.t_response, b.t_response = 0.1, 0.8
    s = summarize([a, b, c], t0=0.0)
    assert s["response_start_ms"]["mean"] == pytest.approx(200.0)  # 100 and 300 ms
    assert s["last_response_start_s"] == pytest.approx(0.8)
    assert s["first_response_start_s"] == pytest.approx(0.1)
    assert s["first_token_s"] == pytest.approx(0.5)  # a's first chunk; c (failed) has none
    assert s["itl_ms"]["mean"] == pytest.approx(500.0)
    assert s["max_in_flight"] == 2  # c starts as a ends


def test_inflight_timeline_and_peak_rate():
    a = rec(0, 0.0, [0.5, 0.6], end=1.0)
    b = rec(1, 0.5, [0.7, 0.8, 0.9], end=2.0)
    assert inflight_timeline([a, b]) == [(0.0, 1), (0.5, 2), (1.0, 1), (2.0, 0)]
    assert peak_output_rate([a, b], bin_s=1.0) == 5.0


def test_peak_rate_counts_tokens_not_chunks():
    # a server streaming 8 tokens a chunk (--stream-interval 8): 3 chunks in the first second
    # carry 24 tokens; the peak must say 24 tok/s, not 3
    a = rec(0, 0.0, [0.1, 0.5, 0.9, 1.5], tokens=32)
    assert peak_output_rate([a], bin_s=1.0) == 24.0
