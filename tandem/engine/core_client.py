"""The API process's handle on the engine core: in a thread of this process, or in a process of
its own (the default: the engine's Python work then never competes with the event loop for the
GIL, which at saturation costs most of the GPU's time).

Both clients take commands with `send` and hand every EngineCoreOutputs to `on_outputs`; when
the core is gone (stopped, crashed, killed) they call `on_exit` once with the error to give the
requests still waiting.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

from tandem.config import EngineConfig
from tandem.engine.core import (
    ABORT,
    STOP,
    EngineCore,
    EngineCoreOutputs,
    EngineInfo,
    EngineUnavailable,
)
from tandem.engine.core_proc import run_engine_core
from tandem.engine.llm_engine import LLMEngine

# "process" (the default): the core runs in a process of its own, as vLLM V1's EngineCoreProc;
# "thread": in a thread of the caller's process
ENGINE_MODES = ("process", "thread")

logger = logging.getLogger("tandem.serve")

OnOutputs = Callable[[EngineCoreOutputs], None]
OnExit = Callable[[EngineUnavailable], None]


def make_client(
    mode: str, config: EngineConfig, on_outputs: OnOutputs, on_exit: OnExit
) -> InprocClient | MPClient:
    if mode == "process":
        core = EngineCoreProc(config)
        return MPClient(core.conns[0], core.info, on_outputs, on_exit, core=core)
    if mode == "thread":
        return InprocClient(config, on_outputs, on_exit)
    raise ValueError(f"engine_mode must be one of {ENGINE_MODES}, got {mode!r}")


class InprocClient:
    """The core stepped by a thread of this process; outputs are handed over without copies."""

    def __init__(self, config: EngineConfig, on_outputs: OnOutputs, on_exit: OnExit):
        self.core = EngineCore(LLMEngine(config), on_outputs)
        self.info: EngineInfo = self.core.info()
        self._on_exit = on_exit
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()

    @property
    def engine(self) -> LLMEngine:
        return self.core.engine

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def send(self, cmds: list[tuple]) -> None:
        for cmd in cmds:
            self._commands.put(cmd)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        if self._thread.is_alive():
            self._commands.put((STOP,))
            self._thread.join(timeout)

    def _get_commands(self, block: bool) -> list[tuple]:
        cmds = []
        try:
            cmds.append(self._commands.get(block=block))
        except queue.Empty:
            return cmds
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _run(self) -> None:
        try:
            self.core.run_busy_loop(self._get_commands)
        except BaseException:
            logger.exception("the engine thread failed")
            raise
        finally:
            self._on_exit(EngineUnavailable("the engine has stopped"))


@dataclass
class EngineCoreConns:
    """One API server's ends of its pipes to the engine core (they cross to a spawned child)."""

    commands: Connection  # write end
    outputs: Connection  # read end


class EngineCoreProc:
    """The engine core in a spawned process (CUDA cannot be forked), with one pair of one-way
    pipes per API server; returns once the engine is built (or raises its start-up error)."""

    def __init__(
        self, config: EngineConfig, num_api_servers: int = 1, start_timeout_s: float | None = None
    ):
        ctx = mp.get_context("spawn")
        cmd_pipes = [ctx.Pipe(duplex=False) for _ in range(num_api_servers)]  # (recv, send)
        out_pipes = [ctx.Pipe(duplex=False) for _ in range(num_api_servers)]
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        self.proc = ctx.Process(
            target=run_engine_core,
            args=(config, [r for r, _ in cmd_pipes], [s for _, s in out_pipes], level),
            name="tandem-engine-core",
            daemon=True,
        )
        self.proc.start()
        for (cmd_recv, _), (_, out_send) in zip(cmd_pipes, out_pipes):
            cmd_recv.close()  # ours closed: the child's end alone keeps each pipe open
            out_send.close()
        self.conns = [EngineCoreConns(s, r) for (_, s), (r, _) in zip(cmd_pipes, out_pipes)]
        try:
            self.info: EngineInfo = self._wait_ready(start_timeout_s)
        except BaseException:  # a failed start, or Ctrl-C while the model loads: the core
            self.proc.kill()  # ignores SIGTERM, and exit would wait on it for good
            self.proc.join(5)
            for conns in self.conns:
                conns.commands.close()
                conns.outputs.close()
            raise

    def _wait_ready(self, timeout_s: float | None) -> EngineInfo:
        """The core's first message on every output pipe: ready (with its info), or failed."""
        info = None
        for conns in self.conns:
            try:
                if not conns.outputs.poll(timeout_s):
                    self.proc.kill()
                    raise RuntimeError(f"the engine process did not start in {timeout_s} s")
                kind, payload = conns.outputs.recv()
            except EOFError:
                self.proc.join(5)
                raise RuntimeError(
                    f"the engine process died while starting (exit code {self.proc.exitcode})"
                ) from None
            if kind == "failed":
                self.proc.join(5)
                raise payload  # the engine's own error: a bad model path stays a ValueError
            info = payload
        return info

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Wait for the core to stop (it does once every API server has gone); kill it if not."""
        self.proc.join(timeout)
        if self.proc.is_alive():
            logger.warning("the engine process did not stop in %s s; killing it", timeout)
            self.proc.kill()
            self.proc.join(5)


class MPClient:
    """An API server's client of an engine-core process, over its two one-way pipes.

    Commands are pickled by the caller (so an unpicklable one fails there) and written by a
    sender thread (a full pipe never blocks the event loop); a receiver thread reads one message
    per engine step. A core that dies is noticed at once: its pipe reaches end-of-file.
    A request's prompt crosses in its first output only (`CoreClients._lean`): it is kept here
    and put back into the later ones, so callers see whole RequestOutputs.
    `core` is the core's process when this client started it (it then stops it too); with
    several API servers the parent process owns it.
    """

    def __init__(
        self,
        conns: EngineCoreConns,
        info: EngineInfo,
        on_outputs: OnOutputs,
        on_exit: OnExit,
        core: EngineCoreProc | None = None,
    ):
        self._cmd_send, self._out_recv = conns.commands, conns.outputs
        self.info = info
        self.core = core
        self.proc = core.proc if core is not None else None
        self._on_outputs, self._on_exit = on_outputs, on_exit
        self._stopping = False
        # unfinished requests' (prompt, prompt token ids), from their first output
        self._prompts: dict[str, tuple[str | None, list[int]]] = {}
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(
            target=self._send_loop, name="tandem-core-send", daemon=True
        )
        self._receiver = threading.Thread(
            target=self._recv_loop, name="tandem-core-recv", daemon=True
        )
        self._sender.start()
        self._receiver.start()

    @property
    def is_alive(self) -> bool:
        return self._receiver.is_alive() and (self.proc is None or self.proc.is_alive())

    def send(self, cmds: list[tuple]) -> None:
        self._outbox.put(ForkingPickler.dumps(cmds))
        for cmd in cmds:
            if cmd[0] == ABORT:
                for rid in cmd[1]:
                    self._prompts.pop(rid, None)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Say STOP (the core aborts this server's requests, and stops if it was the last one);
        wait for the core's own process if this client started it, kill it if it does not stop."""
        self._stopping = True
        self._outbox.put(None)
        if self.core is not None:
            self.core.shutdown(timeout)
        self._receiver.join(5 if self.core is not None else timeout)

    def _send_loop(self) -> None:
        conn = self._cmd_send
        try:
            while True:
                blob = self._outbox.get()
                if blob is None:
                    conn.send_bytes(ForkingPickler.dumps([(STOP,)]))
                    return
                conn.send_bytes(blob)
        except OSError:
            pass  # the core is gone; the receiver reports it
        finally:
            conn.close()

    def _with_prompts(self, msg: EngineCoreOutputs) -> EngineCoreOutputs:
        """Put each output's prompt back (it crossed with the request's first output only)."""
        prompts = self._prompts
        for out in msg.outputs:
            rid = out.request_id
            if out.prompt_token_ids is None:  # (an aborted request's: nobody reads it)
                out.prompt, out.prompt_token_ids = (
                    prompts.pop(rid, (None, [])) if out.finished else prompts.get(rid, (None, [])))
            elif not out.finished:
                prompts[rid] = (out.prompt, out.prompt_token_ids)
        for rid, _ in msg.failed:
            prompts.pop(rid, None)
        return msg

    def _recv_loop(self) -> None:
        conn = self._out_recv
        try:
            while True:
                self._on_outputs(self._with_prompts(conn.recv()))
        except (EOFError, OSError):
            pass
        except BaseException:
            logger.exception("reading the engine process's outputs failed")
        if self._stopping:
            error = EngineUnavailable("the engine has stopped")
        else:
            exit_code = ""
            if self.proc is not None:
                self.proc.join(5)
                exit_code = f" (exit code {self.proc.exitcode})"
            error = EngineUnavailable(
                f"the engine process died unexpectedly{exit_code}; restart the server"
            )
            logger.error("%s", error)
        self._outbox.put(None)  # the sender may stop too
        self._on_exit(error)
