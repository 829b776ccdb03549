"""The server's own counters over a `bench serve` run: its Prometheus `/metrics`, read before the
load and after it.

The client sees latencies; the server's counters say why they are what they are (vLLM's metrics
design: "server-level metrics explain the request-level ones"): how many engine steps the run
took, how long each took, how many tokens a step produced (a batch that was never full shows
here), preemptions and prefix-cache hits. Read from tandem (`tandem:` names) or vLLM (`vllm:`);
another server, or one without `/metrics`, gives no section. The counters are the server's whole:
other traffic during the run counts too.
"""

from __future__ import annotations

import bisect
import re
import threading
import time
import urllib.request
from typing import Self

import numpy as np

from tandem.bench.client import TargetConfig

PREFIXES = ("tandem:", "vllm:")  # tandem's names are vLLM's with this prefix
# a sample line: name{labels} value [timestamp]
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_KIND = re.compile(r'\bkind="([^"]*)"')


def parse_prometheus(text: str) -> dict[str, float]:
    """Samples summed by metric name, and by name and `kind` label where there is one
    (`name{kind=decode}`): the other labels (the model's name) are summed over."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        name, labels = m.group(1), m.group(2) or ""
        kind = _KIND.search(labels)
        key = f"{name}{{kind={kind.group(1)}}}" if kind else name
        out[key] = out.get(key, 0.0) + value
    return out


def scrape(target: TargetConfig, timeout_s: float = 10.0) -> dict[str, float] | None:
    """The server's counters now, or None where it has no Prometheus `/metrics` of tandem's or
    vLLM's names."""
    req = urllib.request.Request(target.base_url + "/metrics", headers=target.headers())
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            text = resp.read().decode("utf-8", "replace")
    except (OSError, ValueError):  # (HTTPError, a 404 included, is an OSError)
        return None
    samples = parse_prometheus(text)
    if not any(k.startswith(PREFIXES) for k in samples):
        return None
    return samples


def over_run(before: dict[str, float] | None, after: dict[str, float] | None) -> dict | None:
    """What the server counted between the two scrapes (None without both)."""
    if before is None or after is None:
        return None
    prefix = next((p for p in PREFIXES if f"{p}generation_tokens_total" in after), None)
    if prefix is None:
        return None

    def delta(name: str) -> float | None:
        key = prefix + name
        return after[key] - before.get(key, 0.0) if key in after else None

    def count(name: str) -> int | None:
        d = delta(name)
        return None if d is None else round(d)

    out: dict = {"source": prefix.rstrip(":"), "generation_tokens": count("generation_tokens_total")}
    if prefix == "tandem:":  # steps by kind, with the host's seconds in them
        kinds = sorted(k.split("kind=")[1][:-1] for k in after
                       if k.startswith(f"{prefix}engine_steps_total{{kind="))
        steps = {}
        for kind in kinds:
            n = count(f"engine_steps_total{{kind={kind}}}") or 0
            sec = delta(f"engine_step_seconds_total{{kind={kind}}}")
            steps[kind] = {"steps": n, "mean_ms": 1e3 * sec / n if n and sec else None}
        out["steps_by_kind"] = steps
        out["engine_steps"] = sum(s["steps"] for s in steps.values())
    else:  # vLLM: a histogram of the tokens (prompt and generated) an engine step scheduled
        n = count("iteration_tokens_total_count")
        out["engine_steps"] = n
        tokens = delta("iteration_tokens_total_sum")
        out["scheduled_tokens_per_step"] = tokens / n if n and tokens is not None else None
    gen, n = out["generation_tokens"], out["engine_steps"]
    out["generation_tokens_per_step"] = gen / n if gen is not None and n else None
    out["preemptions"] = count("num_preemptions_total")
    hits, queries = delta("prefix_cache_hits_total"), delta("prefix_cache_queries_total")
    out["prefix_cache_hit_rate"] = hits / queries if hits is not None and queries else None
    return out


def server_rows(server: dict | None) -> list[tuple[str, object]]:
    """Rows for the report's table."""
    if server is None:
        return [("status", "no /metrics with tandem's or vLLM's counters")]
    rows: list[tuple[str, object]] = [("source", server["source"]),
                                      ("engine steps", server["engine_steps"])]
    for kind, s in (server.get("steps_by_kind") or {}).items():
        rows.append((f"  {kind}: steps / mean host ms", f"{s['steps']} / "
                     + (f"{s['mean_ms']:.2f}" if s["mean_ms"] is not None else "-")))
    if "scheduled_tokens_per_step" in server:
        rows.append(("scheduled tokens per step", server["scheduled_tokens_per_step"]))
    rows += [
        ("generated tokens", server["generation_tokens"]),
        ("generated tokens per step", server["generation_tokens_per_step"]),
        ("preemptions", server["preemptions"]),
        ("prefix-cache hit rate", server["prefix_cache_hit_rate"]),
    ]
    return rows


# The queue gauges, by their names after the prefix (vLLM's and tandem's alike)
RUNNING, WAITING, KV_USAGE = "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"
# What held the batch below its peak, a sample at a time (`QueueSampler.summary`)
STATES = ("full", "queued_in_engine", "not_yet_in_engine", "nothing_to_run")


class QueueSampler:
    """The server's queue gauges (requests running, waiting, KV-cache use) sampled through the
    run, read beside the client's requests in flight: at each sample, where the requests were.
    A batch below its peak while the engine had requests waiting is the scheduler's doing (KV
    blocks, the token budget); while requests were sent but not yet in the engine (in the API
    server, on the wire) it is admission's; with neither it is the load's (arrivals, the drain).
    A sample is timed when its answer came, not when it was asked for: the gauges are the
    server's as it answers, and an API server busy with a burst answers late (0.3-0.7 s on an
    H200 in `tandem bench serve --request-rate inf`), which timed at the asking made the engine
    look full too early. How late the answers came is kept (`delays`) and reported.
    A server without the gauges gives no samples. `scrape_fn` is `scrape`'s stand-in in tests."""

    def __init__(self, target: TargetConfig, interval_s: float = 0.1, enabled: bool = True,
                 scrape_fn=None):
        self.interval_s, self.enabled = interval_s, enabled
        self._scrape = scrape_fn or (lambda: scrape(target, timeout_s=max(1.0, 10 * interval_s)))
        self.prefix: str | None = None
        self.times: list[float] = []  # when each answer came
        self.delays: list[float] = []  # how long each answer took
        self.rows: list[tuple[float, float, float | None]] = []  # running, waiting, KV use
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Self:
        if self.enabled:
            first = self._scrape()
            self.prefix = next((p for p in PREFIXES if first and p + RUNNING in first
                                and p + WAITING in first), None)
        if self.prefix is not None:
            self._thread = threading.Thread(target=self._loop, name="queue-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        next_t = time.perf_counter()
        while not self._stop.is_set():
            asked = time.perf_counter()
            s = self._scrape()
            t = time.perf_counter()
            if s is not None:
                p = self.prefix
                self.times.append(t)
                self.delays.append(t - asked)
                self.rows.append((s.get(p + RUNNING, 0.0), s.get(p + WAITING, 0.0), s.get(p + KV_USAGE)))
            next_t += self.interval_s
            self._stop.wait(max(0.0, next_t - time.perf_counter()))

    def summary(self, timeline: list[tuple[float, int]], window: tuple[float, float]) -> dict | None:
        """The samples inside `window` (perf_counter start, end) with requests in flight by
        `timeline` ([(time, requests in flight from then on)], sorted): the gauges' means and
        peaks, requests sent but not yet in the engine, and the share of samples in each
        state of `STATES` (the batch at its peak, or what held it below)."""
        if self.prefix is None:
            return None
        t_line = [t for t, _ in timeline]
        kept, delays = [], []
        for t, delay, (running, waiting, kv) in zip(self.times, self.delays, self.rows):
            k = bisect.bisect_right(t_line, t) - 1
            in_flight = timeline[k][1] if k >= 0 else 0
            if window[0] <= t <= window[1] and in_flight > 0:
                kept.append((running, waiting, kv, max(0.0, in_flight - running - waiting)))
                delays.append(delay)
        out: dict = {"source": self.prefix.rstrip(":"), "interval_s": self.interval_s, "samples": len(kept)}
        if not kept:
            return out
        running, waiting, kv, before = (np.array(c, dtype=float) for c in zip(*kept))
        peak = running.max()
        short = running < peak
        states = {
            "full": ~short,
            "queued_in_engine": short & (waiting > 0),
            "not_yet_in_engine": short & (waiting == 0) & (before >= 1),
            "nothing_to_run": short & (waiting == 0) & (before < 1),
        }
        kv_known = kv[~np.isnan(kv)]
        out.update(
            running_mean=float(running.mean()), running_peak=float(peak),
            waiting_mean=float(waiting.mean()), waiting_max=float(waiting.max()),
            not_yet_in_engine_mean=float(before.mean()), not_yet_in_engine_max=float(before.max()),
            kv_cache_usage_max=float(kv_known.max()) if kv_known.size else None,
            answer_delay_max_s=max(delays),
            states={name: float(mask.mean()) for name, mask in states.items()},
        )
        return out


    def series(self, t0: float, t_end: float) -> dict:
        """The samples from `t0` to `t_end` (the run: not the client processes' start before
        it), column-wise, with times relative to `t0`."""
        kept = [(t - t0, r) for t, r in zip(self.times, self.rows) if t0 <= t <= t_end]
        return {"t": [t for t, _ in kept], "running": [r[0] for _, r in kept],
                "waiting": [r[1] for _, r in kept]}


def queue_rows(queue: dict | None) -> list[tuple[str, object]]:
    """Rows for the report's table."""
    if queue is None:
        return [("status", "no queue gauges at /metrics (num_requests_running, num_requests_waiting)")]
    if not queue["samples"]:
        return [("samples", 0)]
    s = queue["states"]
    return [
        ("samples (every s)", f"{queue['samples']} ({queue['interval_s']:g})"),
        ("running: mean / peak", f"{queue['running_mean']:.1f} / {queue['running_peak']:.0f}"),
        ("waiting in the engine: mean / max", f"{queue['waiting_mean']:.1f} / {queue['waiting_max']:.0f}"),
        ("sent, not yet in the engine: mean / max",
         f"{queue['not_yet_in_engine_mean']:.1f} / {queue['not_yet_in_engine_max']:.0f}"),
        ("batch at its peak (share of samples)", s["full"]),
        ("  below it, requests waiting in the engine", s["queued_in_engine"]),
        ("  below it, requests not yet in the engine", s["not_yet_in_engine"]),
        ("  below it, nothing left to run", s["nothing_to_run"]),
        ("KV-cache use, max", queue["kv_cache_usage_max"]),
        ("slowest /metrics answer (s; samples are timed at the answer)",
         queue["answer_delay_max_s"]),
    ]
