"""Request metrics summed over the API servers of one engine (`--api-server-count N`).

Each API server observes its own requests (TTFT, ITL, E2E, finish reasons, 503s). So that any of
them can answer a Prometheus scrape for the whole server, each publishes its metrics once a second
to a file of a directory they share (written whole and renamed into place, so a reader never sees
half of one), and `/metrics` sums its own live figures with the others' latest files: at most a
second stale, like vLLM's multiprocess Prometheus directory. The engine's gauges come from the
engine core itself and need no summing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path

from tandem.engine.metrics import ServerMetrics

logger = logging.getLogger("tandem.serve")


class MetricsExchange:
    def __init__(self, directory: str, index: int, interval_s: float = 1.0):
        self.dir = Path(directory)
        self.index = index
        self.interval_s = interval_s
        self._task: asyncio.Task | None = None

    def _path(self, index: int) -> Path:
        return self.dir / f"api-server-{index}.json"

    def publish(self, metrics: ServerMetrics) -> None:
        tmp = self.dir / f".api-server-{self.index}.json.tmp"
        tmp.write_text(json.dumps(metrics.to_dict()))
        os.replace(tmp, self._path(self.index))

    def collect(self, own: ServerMetrics) -> ServerMetrics:
        """Every API server's last published metrics, `own` published first: each file only
        moves forward, so whichever server answers, no counter goes back between scrapes."""
        self.publish(own)
        every = []
        for path in sorted(self.dir.glob("api-server-*.json")):
            try:
                every.append(ServerMetrics.from_dict(json.loads(path.read_text())))
            except (OSError, ValueError, KeyError) as e:  # gone with its server, say
                logger.debug("skipping %s: %s", path, e)
        return ServerMetrics().merged(every)

    def start(self, metrics: ServerMetrics) -> None:
        """Publish `metrics` every interval from the running event loop (once started)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(metrics))

    async def _run(self, metrics: ServerMetrics) -> None:
        while True:
            try:
                self.publish(metrics)
            except OSError as e:
                logger.warning("cannot publish request metrics to %s: %s", self.dir, e)
            await asyncio.sleep(self.interval_s)
