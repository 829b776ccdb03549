"""`tandem serve --api-server-count N`: N API-server processes on one socket, one engine core.

HTTP parsing, request validation, tokenization and streamed chunks are Python work per request:
on the H200 about 0.7 ms per request and 70 us per streamed chunk, so a burst of 256 requests
reached the engine over about 250 ms through one process. With N processes accepting on the same
listening socket (the kernel spreads the connections), that work runs on N cores while the engine
core steps once for all of them (vLLM's `--api-server-count` does the same).

This process binds the socket, starts the engine core, starts the API servers with their pipes,
and watches them: SIGTERM or SIGINT is passed on (each API server drains its in-flight requests,
then hangs up; the core stops after the last), and when any of them dies the others are stopped
and `tandem serve` exits 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass
from multiprocessing.connection import wait

from tandem.config import EngineConfig
from tandem.engine.core import EngineInfo
from tandem.engine.core_client import EngineCoreConns, EngineCoreProc
from tandem.serve.metrics_exchange import MetricsExchange
from tandem.serve.server import print_listening

logger = logging.getLogger("tandem.serve")


@dataclass(frozen=True)
class APIServerArgs:
    """What each API server builds its app and its uvicorn server from."""

    served_model_name: str
    api_key: str | None = None
    chat_template: str | None = None
    model_root: str | None = None
    max_waiting_requests: int | None = None
    shutdown_timeout: float = 30.0
    log_level: str = "info"
    access_log: bool = False
    max_body_bytes: int = 32 << 20
    read_timeout: float | None = None
    metrics_dir: str | None = None  # where the servers publish their request metrics
    parent_pid: int | None = None  # `tandem serve`'s own process: the servers die with it


def run_api_servers(
    config: EngineConfig, sock: socket.socket, count: int, args: APIServerArgs
) -> int:
    """Serve on `sock` with `count` API servers over one engine core until SIGTERM/SIGINT (0) or
    until one of the processes dies (1)."""
    core = EngineCoreProc(config.for_serving(), num_api_servers=count)  # raises the engine's start-up error
    metrics_dir = tempfile.mkdtemp(prefix="tandem-metrics-")
    args = dataclasses.replace(args, metrics_dir=metrics_dir, parent_pid=os.getpid())
    ctx = mp.get_context("spawn")
    servers = [
        ctx.Process(
            target=run_api_server,
            args=(i, sock, core.conns[i], core.info, args),
            name=f"tandem-api-server-{i}",
        )
        for i in range(count)
    ]
    for server in servers:
        server.start()
    for conns in core.conns:  # the API servers hold them now
        conns.commands.close()
        conns.outputs.close()
    pids = ", ".join(str(s.pid) for s in servers)
    print(f"tandem serve: engine core pid {core.proc.pid}; API server pids {pids}", flush=True)
    print_listening(sock)  # connections made before a server accepts wait in the backlog
    sock.close()  # theirs too: once they stop listening, a new connection is refused, not queued

    stopping = False

    def stop_servers(signum=None, frame=None) -> None:
        nonlocal stopping
        stopping = True
        for server in servers:
            if server.is_alive():
                os.kill(server.pid, signal.SIGTERM)  # each drains what it has in flight

    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, stop_servers) for sig in handled}
    failure = None
    # A process is gone once its sentinel is readable (its end of a pipe closed at exit) or a
    # waitpid poll says so; either is enough, and the loop looks at both at least once a second.
    running = {s.sentinel: s for s in servers}
    core_running = True
    try:
        while running:
            watched = list(running) + ([core.proc.sentinel] if core_running else [])
            ready = set(wait(watched, timeout=1.0))
            exited = [s for fd, s in running.items() if fd in ready or not s.is_alive()]
            for server in exited:
                del running[server.sentinel]
                server.join(5)
            if core_running and (core.proc.sentinel in ready or not core.proc.is_alive()):
                core_running = False
                core.proc.join(5)
            if stopping:
                continue  # until every API server has drained and exited
            if not core_running:
                failure = f"the engine process died (exit code {core.proc.exitcode})"
            elif exited:
                failure = f"{exited[0].name} exited (exit code {exited[0].exitcode})"
            if failure:
                print(f"tandem serve: {failure}; stopping", file=sys.stderr, flush=True)
                stop_servers()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for server in servers:
            server.join(args.shutdown_timeout + 10)
            if server.is_alive():
                server.kill()
                server.join(5)
        core.shutdown()  # it stops once every API server has hung up
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return 1 if failure else 0


def run_api_server(
    index: int, sock: socket.socket, conns: EngineCoreConns, info: EngineInfo, args: APIServerArgs
) -> None:
    """One API server's process: the app over its pipes to the shared engine core."""
    from tandem.engine.async_llm import AsyncLLM
    from tandem.serve.app import build_app
    from tandem.serve.server import serve

    _stop_when_the_parent_dies(args.parent_pid)
    level = args.log_level.upper()
    fmt = f"%(levelname)s %(name)s (api server {index}): %(message)s"
    logging.basicConfig(level=level, format=fmt)
    llm = AsyncLLM(max_waiting_requests=args.max_waiting_requests, attach_to=(conns, info))
    try:
        app = build_app(
            llm,
            args.served_model_name,
            api_key=args.api_key,
            chat_template=args.chat_template,
            model_root=args.model_root,
            metrics_exchange=MetricsExchange(args.metrics_dir, index) if args.metrics_dir else None,
            max_body_bytes=args.max_body_bytes,
            body_timeout_s=args.read_timeout,
        )
        code = serve(
            app,
            sock,
            llm=llm,
            shutdown_timeout_s=args.shutdown_timeout,
            log_level=args.log_level,
            access_log=args.access_log,
            read_timeout_s=args.read_timeout,
        )
    finally:
        llm.shutdown()
        _leave_no_metrics_dir(args.metrics_dir, index)
    if code:
        sys.exit(code)


def _leave_no_metrics_dir(metrics_dir: str | None, index: int) -> None:
    """Remove this server's metrics file, and the directory with the last one out: `tandem
    serve` removes it too, but not when it was SIGKILLed."""
    if metrics_dir is None:
        return
    with contextlib.suppress(OSError):
        os.remove(os.path.join(metrics_dir, f"api-server-{index}.json"))
    with contextlib.suppress(OSError):
        os.rmdir(metrics_dir)  # fails while another server's file is there


def _stop_when_the_parent_dies(parent_pid: int | None) -> None:
    """SIGTERM this API server when `tandem serve`'s own process dies, however it dies (a
    SIGKILL gives it no chance to stop its children): it drains, hangs up, and the engine core
    stops after the last one, instead of orphans holding the port and the GPU. Linux only."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if parent_pid is not None and os.getppid() != parent_pid:  # it died before the call
        os.kill(os.getpid(), signal.SIGTERM)
