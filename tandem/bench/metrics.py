"""Serving metrics as the field defines them (vLLM `bench serve`): TTFT, TPOT, ITL, E2E, goodput.

TTFT: request sent -> first token. TPOT: (E2E - TTFT) / (output tokens - 1). ITL: every gap
between streamed chunks. E2E: request sent -> last token. Throughputs divide by the run's
duration, from the start of the schedule to the last response.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

SLO_KEYS = ("ttft", "tpot", "itl", "e2el")  # milliseconds; `itl` is checked against its p99


@dataclass
class RequestRecord:
    """What the client saw for one request. Times are `time.perf_counter()` seconds."""

    index: int
    prompt_len: int = 0  # from the dataset (approximate without a tokenizer)
    expected_output_len: int = 0  # max_tokens sent
    t_scheduled: float = 0.0  # when the arrival schedule wanted it sent
    t_dispatched: float = 0.0  # when the client got to it (late if the client is overloaded)
    t_start: float = 0.0  # when it was sent (later than dispatch if max_concurrency held it)
    t_response: float = 0.0  # when the response's headers came (the server took the request)
    token_times: list[float] = field(default_factory=list)  # one per streamed token chunk
    t_end: float = 0.0  # stream closed or failure seen
    ok: bool = False
    finished: bool = False  # a streamed choice carried a finish_reason
    error: str = ""
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None

    @property
    def output_tokens(self) -> int:
        """Server-reported completion tokens; the count of streamed chunks if it sent no usage."""
        if self.usage_completion_tokens is not None:
            return self.usage_completion_tokens
        return len(self.token_times)

    @property
    def prompt_tokens(self) -> int:
        return self.usage_prompt_tokens if self.usage_prompt_tokens is not None else self.prompt_len


def ttft(r: RequestRecord) -> float:
    return r.token_times[0] - r.t_start


def e2e(r: RequestRecord) -> float:
    return r.token_times[-1] - r.t_start


def tpot(r: RequestRecord) -> float | None:
    """None for a single-token output, where decode time is undefined (vLLM leaves it out)."""
    n = r.output_tokens
    if n <= 1:
        return None
    return (e2e(r) - ttft(r)) / (n - 1)


def itls(r: RequestRecord) -> list[float]:
    t = r.token_times
    return [b - a for a, b in itertools.pairwise(t)]


def distribution(values_s: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    """mean, median, p90, p99 (numpy's linear interpolation, as vLLM), std, min, max; in ms."""
    keys = ("mean", "median", "p90", "p99", "std", "min", "max")
    if not values_s:
        return dict.fromkeys(keys)
    a = np.asarray(values_s, dtype=np.float64) * scale
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    vals = (a.mean(), p50, p90, p99, a.std(), a.min(), a.max())
    return {k: float(v) for k, v in zip(keys, vals)}


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft=1000,tpot=50' -> {'ttft': 1000.0, 'tpot': 50.0} (milliseconds)."""
    if not text:
        return {}
    slo: dict[str, float] = {}
    for part in text.replace(" ", ",").split(","):
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep:
            key, sep, value = part.partition(":")  # vLLM's --goodput spelling
        key = {"e2e": "e2el"}.get(key.strip().lower(), key.strip().lower())
        if key not in SLO_KEYS or not sep:
            raise ValueError(f"bad SLO {part!r}: expected KEY=MS with KEY in {SLO_KEYS}")
        ms = float(value)
        if ms <= 0:
            raise ValueError(f"SLO {key} must be > 0 ms, got {ms}")
        slo[key] = ms
    return slo


def meets_slo(r: RequestRecord, slo: dict[str, float]) -> bool:
    """A request is good when it succeeded and every per-request SLO holds (vLLM's goodput)."""
    if not r.ok:
        return False
    checks = {"ttft": ttft(r), "tpot": tpot(r), "e2el": e2e(r)}
    for key, limit_ms in slo.items():
        value = checks.get(key)
        if key == "itl":
            gaps = itls(r)
            value = float(np.percentile(gaps, 99)) if gaps else None
        if value is not None and value * 1000.0 > limit_ms:
            return False
    return True


def inflight_timeline(records: list[RequestRecord]) -> list[tuple[float, int]]:
    """Step function of requests in flight: [(time, count from this time on)], sorted."""
    events = [(r.t_start, 1) for r in records] + [(r.t_end, -1) for r in records]
    events.sort()
    timeline, n = [], 0
    for t, d in events:
        n += d
        if timeline and timeline[-1][0] == t:
            timeline[-1] = (t, n)
        else:
            timeline.append((t, n))
    return timeline


def peak_output_rate(records: list[RequestRecord], bin_s: float = 1.0) -> float:
    """Most output tokens in any `bin_s` window, per second (vLLM's peak output tok/s). A chunk
    may carry several tokens (a server's stream interval): each request's tokens (its usage) are
    spread evenly over its chunks, so the peak is in tokens, comparable with the mean."""
    ok = [r for r in records if r.ok and r.token_times]
    if not ok:
        return 0.0
    t0 = min(r.token_times[0] for r in ok)
    tokens: Counter[int] = Counter()
    for r in ok:
        per_chunk = r.output_tokens / len(r.token_times)
        for t in r.token_times:
            tokens[int((t - t0) // bin_s)] += per_chunk
    return max(tokens.values()) / bin_s


def summarize(records: list[RequestRecord], t0: float, slo: dict[str, float] | None = None) -> dict:
    """Aggregate figures for one run; `t0` is when the arrival schedule started."""
    ok = [r for r in records if r.ok]
    duration = max((r.t_end for r in records), default=t0) - t0
    duration = max(duration, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    good = sum(meets_slo(r, slo) for r in ok) if slo else None
    errors = Counter(r.error for r in records if not r.ok)
    timeline = inflight_timeline(records)
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "output_tokens_from_usage": all(r.usage_completion_tokens is not None for r in ok),
        "short_outputs": sum(r.output_tokens < r.expected_output_len for r in ok),
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "peak_output_throughput": peak_output_rate(records),
        "max_in_flight": max((n for _, n in timeline), default=0),
        "slo_ms": slo or None,
        "good_requests": good,
        "goodput": None if good is None else good / duration,
        "ttft_ms": distribution([ttft(r) for r in ok]),
        # request sent -> response headers: the client, the wire and the API server's admission
        "response_start_ms": distribution([r.t_response - r.t_start for r in ok if r.t_response]),
        "first_response_start_s": min((r.t_response - t0 for r in ok if r.t_response), default=None),
        "last_response_start_s": max((r.t_response - t0 for r in ok if r.t_response), default=None),
        # how long the server took to start producing at all (a burst's admission)
        "first_token_s": min((r.token_times[0] - t0 for r in ok if r.token_times), default=None),
        "tpot_ms": distribution([v for r in ok if (v := tpot(r)) is not None]),
        "itl_ms": distribution([g for r in ok for g in itls(r)]),
        "e2el_ms": distribution([e2e(r) for r in ok]),
        "errors": [{"error": e, "count": n} for e, n in errors.most_common(5)],
    }


def per_request_rows(records: list[RequestRecord]) -> list[dict]:
    """One flat row per request (ms), for CSV and the saved JSON."""
    rows = []
    for r in records:
        row = {
            "index": r.index,
            "ok": r.ok,
            "prompt_tokens": r.prompt_tokens,
            "output_tokens": r.output_tokens,
            "expected_output_tokens": r.expected_output_len,
            "schedule_lag_ms": (r.t_dispatched - r.t_scheduled) * 1000.0,
            "queue_ms": (r.t_start - r.t_dispatched) * 1000.0,
            "response_start_ms": (r.t_response - r.t_start) * 1000.0 if r.t_response else None,
            "ttft_ms": None,
            "tpot_ms": None,
            "e2el_ms": None,
            "error": r.error,
        }
        if r.ok:
            tp = tpot(r)
            row.update(ttft_ms=ttft(r) * 1e3, e2el_ms=e2e(r) * 1e3)
            row["tpot_ms"] = None if tp is None else tp * 1e3
        rows.append(row)
    return rows
