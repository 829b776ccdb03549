"""ServeConfig: the server's own settings (the engine's are EngineConfig); `tandem serve` reads
its flags' defaults from here."""

from __future__ import annotations

import os
from dataclasses import dataclass

from tandem.engine.core_client import ENGINE_MODES

# `api_server_count=None` on a CUDA engine in its own process: one API server per this many of
# the host's CPU cores, at most AUTO_API_SERVERS_MAX (docs/serving.md has the measurements)
AUTO_CORES_PER_API_SERVER = 8
AUTO_API_SERVERS_MAX = 2


@dataclass
class ServeConfig:
    # "process": the engine core runs in a process of its own (as vLLM V1's EngineCoreProc), so
    # its Python work never competes with the HTTP event loop for the GIL. "thread": in a thread
    # of the server's process (one process, slower at saturation).
    engine_mode: str = "process"
    # API-server processes sharing the listening socket and one engine core (vLLM's
    # --api-server-count): HTTP, validation, tokenization and streaming are Python work per
    # request, and at hundreds of requests per second one process is the bottleneck. None: as
    # `auto_api_server_count` picks (2 on a CUDA host of 16 or more cores, else 1; vLLM: 1).
    api_server_count: int | None = None
    # Admission control, in sequences (prompts x n): beyond this many waiting answer 503; a
    # request holding more than this on its own answers 400 (no retry can help it).
    max_waiting_requests: int = 4096
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish after SIGTERM
    max_request_body_mb: float = 32.0  # a larger request body is a 413 (/update_weights exempt)
    # seconds a client may take to send a request's headers, and again its body
    request_read_timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.engine_mode not in ENGINE_MODES:
            raise ValueError(
                f"engine_mode must be one of {', '.join(ENGINE_MODES)}, got {self.engine_mode!r}"
            )
        count = self.api_server_count
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise ValueError(
                f"api_server_count must be an int >= 1 or None (picked from the host), got {count!r}"
            )
        if (count or 1) > 1 and self.engine_mode != "process":
            raise ValueError(
                f"api_server_count {self.api_server_count} needs engine_mode 'process' (the API "
                f"servers share an engine-core process), got {self.engine_mode!r}"
            )
        if self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if not self.max_request_body_mb > 0:
            raise ValueError(f"max_request_body_mb must be > 0, got {self.max_request_body_mb}")
        if not self.request_read_timeout > 0:
            raise ValueError(f"request_read_timeout must be > 0, got {self.request_read_timeout}")

    def resolved_api_server_count(self, device_type: str, enable_admin_api: bool = False) -> int:
        """`api_server_count`, or where it is None `auto_api_server_count`'s choice."""
        if self.api_server_count is not None:
            return self.api_server_count
        return auto_api_server_count(device_type, self.engine_mode, enable_admin_api)

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_request_body_mb * (1 << 20))


def auto_api_server_count(device_type: str, engine_mode: str, enable_admin_api: bool,
                          cpu_cores: int | None = None) -> int:
    """API servers for a server given no `--api-server-count`: more than one only for a CUDA
    engine in its own process without the admin API (whose routes live in one server), one per
    AUTO_CORES_PER_API_SERVER cores up to AUTO_API_SERVERS_MAX. A burst of requests is
    admitted by the API servers' event loops, one request at a time each (0.5-0.7 ms of Python a
    request on an H200 host): on a CPU engine the cores are the engine's."""
    if device_type != "cuda" or engine_mode != "process" or enable_admin_api:
        return 1
    if cpu_cores is None:  # the cores this process may run on (a container's share)
        affinity = getattr(os, "sched_getaffinity", None)
        cpu_cores = len(affinity(0)) if affinity else os.cpu_count() or 1
    return max(1, min(AUTO_API_SERVERS_MAX, cpu_cores // AUTO_CORES_PER_API_SERVER))
