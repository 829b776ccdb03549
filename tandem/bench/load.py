"""Arrival schedules: when each request is sent (Poisson, gamma, constant gaps, all at once).

Follows vLLM's `bench serve`: the first request goes at 0, the gaps after it are gamma-distributed
with shape `burstiness` and mean 1/rate (burstiness 1 is a Poisson process; below 1 is burstier,
above 1 smoother). `--max-concurrency` caps requests in flight on top of any schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

RATE_TYPES = ("poisson", "constant")


@dataclass
class LoadConfig:
    """How requests arrive. `request_rate` inf sends everything at once."""

    request_rate: float = math.inf  # requests/s
    burstiness: float = 1.0  # gamma shape; 1.0 = Poisson
    rate_type: str = "poisson"  # poisson (gamma with burstiness) | constant (even gaps)
    max_concurrency: int | None = None  # cap on requests in flight; None: no cap
    max_seconds: float | None = None  # stop sending new requests after this long
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0 (1.0 is Poisson), got {self.burstiness}")
        if self.rate_type not in RATE_TYPES:
            raise ValueError(f"rate_type must be one of {RATE_TYPES}, got {self.rate_type!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1 or None, got {self.max_concurrency}")
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise ValueError(f"max_seconds must be > 0 or None, got {self.max_seconds}")

    def describe(self) -> str:
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:.3g}/s"
        kind = "" if math.isinf(self.request_rate) else f" {self.rate_type}"
        if self.rate_type == "poisson" and self.burstiness != 1.0 and kind:
            kind = f" gamma(burstiness={self.burstiness:g})"
        conc = f", concurrency<={self.max_concurrency}" if self.max_concurrency else ""
        return f"rate {rate}{kind}{conc}"


def arrival_offsets(n: int, cfg: LoadConfig) -> list[float]:
    """Send time of each of `n` requests, in seconds from the start of the run."""
    if n <= 0:
        return []
    if math.isinf(cfg.request_rate):
        return [0.0] * n
    if cfg.rate_type == "constant":
        return [i / cfg.request_rate for i in range(n)]
    rng = np.random.default_rng(cfg.seed)
    theta = 1.0 / (cfg.request_rate * cfg.burstiness)  # gamma scale: mean gap = 1/rate
    gaps = rng.gamma(shape=cfg.burstiness, scale=theta, size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


REQUESTS_PER_CLIENT_PROCESS = 256  # sent at once; more make one process's loop the run's start


def auto_client_processes(num_requests: int, load: LoadConfig, cpus: int) -> int:
    """Client processes when none are asked for. All at once (an infinite rate), one process's
    event loop does a burst's requests one after another: 1,024 took it ~220 ms on an H200 host,
    and the server's start waited on it (docs/serving.md). So one process per
    REQUESTS_PER_CLIENT_PROCESS requests sent at once (fewer under a concurrency cap), up to a
    quarter of `cpus` (the server shares the machine); one at a finite rate, where the gaps
    spread the dispatching (the client's CPU warning says when it is not enough)."""
    if not math.isinf(load.request_rate) or num_requests <= 0:
        return 1
    burst = min(num_requests, load.max_concurrency or num_requests)
    return max(1, min(math.ceil(burst / REQUESTS_PER_CLIENT_PROCESS), cpus // 4))


def split_for_workers(n_items: int, workers: int) -> list[list[int]]:
    """Round-robin item indices over workers; with a shared schedule this keeps the global
    arrival process exact (each worker sends its items at their global offsets)."""
    workers = max(1, min(workers, n_items)) if n_items else 1
    return [list(range(w, n_items, workers)) for w in range(workers)]


def split_concurrency(max_concurrency: int | None, workers: int) -> list[int | None]:
    """Share a global in-flight cap over workers (the first ones take the remainder)."""
    if max_concurrency is None:
        return [None] * workers
    if max_concurrency < workers:
        raise ValueError(
            f"max_concurrency ({max_concurrency}) must be >= num_client_processes ({workers})"
        )
    base, extra = divmod(max_concurrency, workers)
    return [base + (w < extra) for w in range(workers)]
