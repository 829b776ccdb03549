"""ServeConfig: the server's own settings (the engine's are EngineConfig); `tandem serve` reads
its flags' defaults from here."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.core_client import ENGINE_MODES


@dataclass
class ServeConfig:
    # "process": the engine core runs in a process of its own (as vLLM V1's EngineCoreProc), so
    # its Python work never competes with the HTTP event loop for the GIL. "thread": in a thread
    # of the server's process (one process, slower at saturation).
    engine_mode: str = "process"
    # API-server processes sharing the listening socket and one engine core (vLLM's
    # --api-server-count): HTTP, validation, tokenization and streaming are Python work per
    # request, and at hundreds of requests per second one process is the bottleneck.
    api_server_count: int = 1
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
        if self.api_server_count < 1:
            raise ValueError(f"api_server_count must be >= 1, got {self.api_server_count}")
        if self.api_server_count > 1 and self.engine_mode != "process":
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

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_request_body_mb * (1 << 20))
