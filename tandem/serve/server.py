"""Running the app under uvicorn: bind, serve, and on SIGTERM/SIGINT shut down gracefully.

Shutdown: stop accepting connections, let in-flight requests finish for up to
`shutdown_timeout_s`, cancel (and so abort) the rest, then stop the engine thread; exit 0.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading

import uvicorn

from tandem.engine.gc_pause import frozen_heap


class _Server(uvicorn.Server):
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
    app, shutdown_timeout_s: float = 30.0, log_level: str = "info", access_log: bool = False
) -> uvicorn.Server:
    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=access_log,
        timeout_keep_alive=5,
        timeout_graceful_shutdown=shutdown_timeout_s,
        lifespan="off",
    )
    return _Server(config)


def serve(app, sock: socket.socket, **kwargs) -> None:
    """Serve `app` on `sock` until SIGTERM/SIGINT (in the main thread) and a graceful shutdown.
    No full GC pass walks the heap that exists before serving starts (`frozen_heap`)."""
    with frozen_heap():
        make_server(app, **kwargs).run(sockets=[sock])
