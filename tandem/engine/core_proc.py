"""The engine core in a process of its own (vLLM V1's EngineCoreProc): its entry point.

It serves one API server (`tandem serve`), or several sharing its socket (`--api-server-count`),
each over a pair of one-way pipes (`core_fanout.CoreClients`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from multiprocessing.connection import Connection

from tandem.config import EngineConfig
from tandem.engine.core import EngineCore
from tandem.engine.core_fanout import CoreClients, portable
from tandem.engine.gc_pause import freeze_for_good
from tandem.engine.llm_engine import LLMEngine

logger = logging.getLogger("tandem.serve")


def run_engine_core(
    config: EngineConfig,
    commands: list[Connection],
    outputs: list[Connection],
    log_level: str = "INFO",
) -> None:
    """Build the engine, say ready (or why not) on every output pipe, then run the loop until
    every API server has gone: told it to stop, or closed its pipe.

    SIGINT and SIGTERM are ignored here: a Ctrl-C in a terminal reaches the whole process group,
    and the engine must keep stepping while the API servers drain in-flight requests; it stops
    when they have gone.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if len(commands) == 1:
        _die_with_the_parent()
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s (engine core): %(message)s")
    _leave_cores_to_the_api_servers(len(commands))
    try:
        engine = LLMEngine(config)
    except Exception as e:  # the API side reports it in one line; the traceback at debug level
        if logger.isEnabledFor(logging.DEBUG):
            logger.exception("building the engine failed")
        for conn in outputs:
            conn.send(("failed", portable(e)))
        return
    clients = CoreClients(commands, outputs)
    core = EngineCore(engine, clients.send)
    info = core.info()
    for conn in outputs:
        conn.send(("ready", info))
    clients.start()
    freeze_for_good()  # this process lives for its engine: full GC passes skip the start-up heap
    try:
        core.run_busy_loop(clients.get_commands)
    finally:
        clients.close()  # what the last iterations sent (aborted requests' failures) goes out first
        core.weight_sync.close()


def _die_with_the_parent(interval_s: float = 0.5) -> None:
    """Exit at once when the API server that started this core dies (a SIGKILL gives it no
    chance to say STOP): its pipe's end-of-file is only seen between two steps, and one long CPU
    prefill takes tens of seconds. A thread watches the parent (the step releases the GIL)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os._exit(1)  # nobody is left to serve: no drain, no clean-up to wait for

    threading.Thread(target=watch, name="tandem-parent-watch", daemon=True).start()


def _leave_cores_to_the_api_servers(num_api_servers: int) -> None:
    """Intra-op threads: all cores but one per API server, unless OMP_NUM_THREADS says otherwise
    (vLLM's workers do the like). With every core, the pool's spinning threads starve the API
    servers and, waiting at their barriers for a descheduled peer, the engine itself: measured on
    a 2-core CPU box, a step took 10-40x longer."""
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(max(1, (cores or 1) - num_api_servers))
