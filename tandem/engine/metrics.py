"""Server metrics in the Prometheus text format (hand-written: counters, gauges, histograms).

Names follow vLLM's (`vllm:` becomes `tandem:`), so existing dashboards need one substitution.
Latencies are observed in the event loop as the server sees each output; engine-side figures
(queue lengths, KV-cache usage, prefix-cache hits) come from the engine core's last snapshot,
which travels with its step outputs.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass

from tandem.outputs import RequestOutput

# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# fmt: on


@dataclass(frozen=True)
class EngineStats:
    """What the engine core publishes after each iteration (replaced whole, never mutated)."""

    num_running: int = 0  # requests with a sequence in the running batch
    num_waiting: int = 0  # requests queued in the engine, none of their sequences running
    num_waiting_seqs: int = 0  # sequences queued in the engine (admission control counts them)
    num_added: int = 0  # sequences of the add commands the engine core has processed
    num_unfinished: int = 0  # requests the engine holds (running, waiting or preempted)
    kv_cache_usage: float = 0.0
    num_blocks: int = 0
    num_free_blocks: int = 0
    prefix_queries: int = 0  # tokens looked up in the prefix cache
    prefix_hits: int = 0
    num_preemptions: int = 0
    generation_tokens: int = 0
    is_sleeping: bool = False
    weights_version: int = 0
    # engine steps by kind ("decode" and "prefill_or_mixed": each a CUDA graph where captured),
    # and the host seconds they took: {kind: (steps, seconds)}
    step_stats: dict[str, tuple[int, float]] | None = None


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def merge(self, other: Histogram) -> None:
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]
        self.sum += other.sum
        self.count += other.count

    def lines(self, name: str, labels: str) -> list[str]:
        out, cumulative = [], 0
        for le, n in zip(self.buckets, self.counts):
            cumulative += n
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {cumulative}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.count}')
        out += [f"{name}_sum{{{labels}}} {self.sum}", f"{name}_count{{{labels}}} {self.count}"]
        return out


class ServerMetrics:
    """Request-level metrics, updated from the event loop thread only."""

    def __init__(self) -> None:
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.prompt_tokens = 0
        self.finished: Counter[str] = Counter()  # finish reason -> requests
        self.rejected = 0  # 503s from admission control

    def to_dict(self) -> dict:
        hists = {name: (h.counts, h.sum, h.count) for name, h in self._histograms().items()}
        return {
            "histograms": hists,
            "prompt_tokens": self.prompt_tokens,
            "finished": dict(self.finished),
            "rejected": self.rejected,
        }

    @classmethod
    def from_dict(cls, d: dict) -> ServerMetrics:
        m = cls()
        for name, (counts, total, count) in d["histograms"].items():
            h = m._histograms()[name]
            h.counts, h.sum, h.count = list(counts), total, count
        m.prompt_tokens, m.rejected = d["prompt_tokens"], d["rejected"]
        m.finished = Counter(d["finished"])
        return m

    def merged(self, others: list[ServerMetrics]) -> ServerMetrics:
        """A new ServerMetrics summing this one and `others` (API servers of one engine)."""
        total = ServerMetrics.from_dict(self.to_dict())
        for other in others:
            for name, h in total._histograms().items():
                h.merge(other._histograms()[name])
            total.prompt_tokens += other.prompt_tokens
            total.finished += other.finished
            total.rejected += other.rejected
        return total

    def _histograms(self) -> dict[str, Histogram]:
        return {"ttft": self.ttft, "itl": self.itl, "e2e": self.e2e}

    def observe_finished(self, out: RequestOutput, latency: float) -> None:
        self.e2e.observe(latency)
        self.prompt_tokens += len(out.prompt_token_ids)
        for c in out.outputs:
            self.finished[c.finish_reason or "abort"] += 1

    def render(self, stats: EngineStats, model_name: str) -> str:
        model = f'model_name="{_escape(model_name)}"'
        hit_rate = stats.prefix_hits / stats.prefix_queries if stats.prefix_queries else 0.0
        # fmt: off
        scalars = [  # (name, kind, help, value)
            ("num_requests_running", "gauge", "Requests in the running batch.", stats.num_running),
            ("num_requests_waiting", "gauge", "Requests waiting to be scheduled.",
             stats.num_waiting),
            ("kv_cache_usage_perc", "gauge", "Fraction of KV-cache blocks in use (0-1).",
             stats.kv_cache_usage),
            ("num_gpu_blocks", "gauge", "KV-cache blocks in all.", stats.num_blocks),
            ("prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache.",
             stats.prefix_queries),
            ("prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache.",
             stats.prefix_hits),
            ("prefix_cache_hit_rate", "gauge", "prefix_cache_hits / prefix_cache_queries.",
             hit_rate),
            ("num_preemptions", "counter", "Sequences preempted for lack of KV blocks.",
             stats.num_preemptions),
            ("prompt_tokens", "counter", "Prompt tokens of finished requests.",
             self.prompt_tokens),
            ("generation_tokens", "counter", "Tokens generated.", stats.generation_tokens),
            ("request_rejected", "counter", "Requests refused with 503 (waiting queue full).",
             self.rejected),
        ]
        histograms = [
            ("time_to_first_token_seconds", "Time to first token (streamed requests).", self.ttft),
            ("inter_token_latency_seconds", "Gap between streamed outputs.", self.itl),
            ("e2e_request_latency_seconds", "End-to-end request latency.", self.e2e),
        ]
        # fmt: on
        out: list[str] = []
        for name, kind, help_, value in scalars:
            suffix = "_total" if kind == "counter" else ""
            out += _header(name, kind, help_) + [f"tandem:{name}{suffix}{{{model}}} {value}"]
        out += _header("request_success", "counter", "Finished requests by finish reason.")
        for reason in sorted(self.finished) or ["stop"]:
            labels = f'{model},finished_reason="{reason}"'
            out.append(f"tandem:request_success_total{{{labels}}} {self.finished[reason]}")
        out += _header("engine_steps", "counter", "Engine steps by kind (decode, prefill_or_mixed).")
        steps = stats.step_stats or {}
        for kind, (n, _) in sorted(steps.items()):
            out.append(f'tandem:engine_steps_total{{{model},kind="{kind}"}} {n}')
        out += _header("engine_step_seconds", "counter", "Host seconds spent in engine steps, by kind.")
        for kind, (_, sec) in sorted(steps.items()):
            out.append(f'tandem:engine_step_seconds_total{{{model},kind="{kind}"}} {sec}')
        for name, help_, hist in histograms:
            out += _header(name, "histogram", help_) + hist.lines(f"tandem:{name}", model)
        return "\n".join(out) + "\n"


def _header(name: str, kind: str, help_: str) -> list[str]:
    return [f"# HELP tandem:{name} {help_}", f"# TYPE tandem:{name} {kind}"]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
