"""/health, /v1/models, /version and the Prometheus /metrics."""

from __future__ import annotations

import re

import pytest

from .helpers import MODEL_NAME


def _samples(text: str) -> dict[str, float]:
    """'name{labels}' -> value, for every sample line of a Prometheus text exposition."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def test_health_models_version(server):
    assert server.get("/health")[0] == 200
    status, _, models = server.get("/v1/models")
    assert status == 200 and models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == MODEL_NAME and card["max_model_len"] == server.llm.max_model_len
    status, _, version = server.get("/version")
    assert status == 200 and version["version"]


def test_metrics(server):
    prompt = "The capital of France is Paris. The capital of Italy is Rome. " * 3  # > 2 blocks
    label = f'model_name="{MODEL_NAME}"'
    itl_key = f"tandem:inter_token_latency_seconds_count{{{label}}}"
    itl_before = _samples(server.get("/metrics")[2]).get(itl_key, 0)
    chunks = []
    for _ in range(2):
        events = server.stream("/v1/completions", {"prompt": prompt, "max_tokens": 5, "ignore_eos": True})
        chunks.append(sum(1 for e in events if e.get("choices")))
    server.post(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True},
    )
    server.wait_idle()
    status, headers, text = server.get("/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    for family in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_hit_rate",
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "generation_tokens",
        "request_success",
    ):
        assert f"# TYPE tandem:{family} " in text, family
    m = _samples(text)
    assert m[f"tandem:num_requests_running{{{label}}}"] == 0
    assert m[f"tandem:kv_cache_usage_perc{{{label}}}"] == 0.0
    assert m[f"tandem:generation_tokens_total{{{label}}}"] >= 13
    assert m[f"tandem:time_to_first_token_seconds_count{{{label}}}"] >= 2
    # one per gap between streamed chunks: at most 4 per 5-token request, fewer where deltas that
    # queued up left as one chunk (output coalescing, more of it on a loaded machine), so counted
    # from the chunks these streams received, not assumed
    itl = m[itl_key] - itl_before
    assert itl == sum(n - 1 for n in chunks) and itl <= 8
    assert m[f"tandem:e2e_request_latency_seconds_count{{{label}}}"] >= 3
    assert m[f'tandem:request_success_total{{{label},finished_reason="length"}}'] >= 3
    assert 0 < m[f"tandem:prefix_cache_hit_rate{{{label}}}"] < 1  # the second prompt hit
    steps = {k: m[f'tandem:engine_steps_total{{{label},kind="{k}"}}'] for k in ("decode", "prefill_or_mixed")}
    assert steps["prefill_or_mixed"] >= 1 and sum(steps.values()) >= 5  # 5 tokens of one request
    assert m[f'tandem:engine_step_seconds_total{{{label},kind="decode"}}'] > 0
    buckets = [v for k, v in m.items() if k.startswith("tandem:e2e_request_latency_seconds_bucket")]
    assert (
        buckets == sorted(buckets)
        and buckets[-1] == m[f"tandem:e2e_request_latency_seconds_count{{{label}}}"]
    )
    assert all(re.fullmatch(r"tandem:[a-z0-9_]+(\{[^}]*\})?", k) for k in m)


def test_bench_serve_reads_this_servers_counters(server):
    """`bench serve` against tandem: its server section counts exactly the tokens the client
    received (the warm-up's left out), in decode and prompt steps with their host time."""
    from tandem.bench.serve import run_benchmark
    from tests.bench.conftest import quick_config

    server.wait_idle()
    report = run_benchmark(quick_config(server.url, num_prompts=6, output_len=4),
                           show_progress=False)
    res = report["results"]
    assert res["completed"] == 6 and res["total_output_tokens"] == 24
    run = res["server"]
    assert run["source"] == "tandem" and run["generation_tokens"] == 24
    steps = run["steps_by_kind"]
    assert steps["decode"]["steps"] > 0 and steps["decode"]["mean_ms"] > 0
    assert steps["prefill_or_mixed"]["steps"] > 0
    assert run["engine_steps"] == sum(s["steps"] for s in steps.values())
    assert run["preemptions"] == 0
    queue = res["server_queue"]  # its gauges, sampled while the requests were in flight
    assert queue["source"] == "tandem"
    if queue["samples"]:
        assert queue["running_peak"] <= 6 and sum(queue["states"].values()) == pytest.approx(1.0)
