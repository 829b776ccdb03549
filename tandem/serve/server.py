"""Running the app under uvicorn: bind, serve, and on SIGTERM/SIGINT shut down gracefully.

Shutdown: stop accepting connections, let in-flight requests finish for up to
`shutdown_timeout_s`, then fail the rest with a clear error (a stream ends with an error event
and `[DONE]`), and stop the engine; exit 0. If the engine process dies, the server fails what is
in flight, stops and exits 1, so that a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
from collections.abc import Callable

import uvicorn

from tandem.engine.gc_pause import frozen_heap

_FLUSH_S = 5.0  # after failing what is in flight: time for the last events to reach the clients


class _Server(uvicorn.Server):
    on_drain_timeout: Callable[[], None] | None = None
    drain_timeout_s: float = 30.0

    async def _wait_tasks_to_complete(self) -> None:
        # uvicorn cancels the requests still running when its grace period ends, which cuts a
        # stream without an error event or [DONE]; before that we fail them through the engine,
        # so each ends as any failed request does.
        if self.on_drain_timeout is None:
            return await super()._wait_tasks_to_complete()
        try:
            return await asyncio.wait_for(super()._wait_tasks_to_complete(), self.drain_timeout_s)
        except asyncio.TimeoutError:
            self.on_drain_timeout()
        await super()._wait_tasks_to_complete()  # bounded by uvicorn's own timeout

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn re-raises the signal after its graceful shutdown, which kills the process with
        # status 143; we finish our own shutdown (the engine thread) and exit 0 instead.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: an ephemeral one; read it from getsockname)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.listen(2048)
    return sock


def print_listening(sock: socket.socket) -> None:
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    print(f"tandem serve: listening on http://{url_host}:{port}", flush=True)


def make_server(
    app,
    shutdown_timeout_s: float = 30.0,
    log_level: str = "info",
    access_log: bool = False,
    read_timeout_s: float | None = None,
    on_drain_timeout: Callable[[], None] | None = None,
) -> uvicorn.Server:
    """With `read_timeout_s`, a connection that has not sent a request's headers that long
    after connecting (or after its previous response) is closed. With `on_drain_timeout`, it is
    called when the shutdown grace period ends with requests still running."""
    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=access_log,
        timeout_keep_alive=5,
        timeout_graceful_shutdown=shutdown_timeout_s + (_FLUSH_S if on_drain_timeout else 0),
        lifespan="off",
        http=_with_header_timeout(read_timeout_s) if read_timeout_s else "auto",
    )
    server = _Server(config)
    server.on_drain_timeout = on_drain_timeout
    server.drain_timeout_s = shutdown_timeout_s
    return server


def serve(app, sock: socket.socket, llm=None, **kwargs) -> int:
    """Serve `app` on `sock` until SIGTERM/SIGINT (in the main thread) and a graceful shutdown,
    or until the engine of `llm` (an AsyncLLM) dies; returns the exit status (1: the engine
    died). No full GC pass walks the heap that exists before serving starts (`frozen_heap`)."""
    if llm is not None:
        kwargs["on_drain_timeout"] = lambda: llm.fail_in_flight(
            "the server is shutting down; the request was not finished in the shutdown grace "
            "period"
        )
    server = make_server(app, **kwargs)
    if llm is not None:
        def stop() -> None:
            server.should_exit = True  # uvicorn's main loop looks at it every 0.1 s

        llm.on_engine_death = stop
    with frozen_heap():
        server.run(sockets=[sock])
    return 1 if llm is not None and llm.engine_died else 0


def _with_header_timeout(timeout_s: float) -> type:
    """uvicorn's HTTP protocol (httptools where installed, else h11, as its "auto") closing a
    connection whose request headers are not complete within `timeout_s` (slow-loris clients
    otherwise hold a connection as long as they like)."""
    try:
        import httptools  # noqa: F401

        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base

    class HeaderTimeoutProtocol(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            timer = getattr(self, "_header_timer", None)
            if timer is not None:
                timer.cancel()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            old = getattr(self, "_header_timer", None)
            if old is not None:
                old.cancel()
            cycle = self.cycle  # a new request replaces it once its headers are in
            self._header_timer = self.loop.call_later(timeout_s, self._header_timeout, cycle)

        def _header_timeout(self, cycle) -> None:
            if self.cycle is cycle and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol
