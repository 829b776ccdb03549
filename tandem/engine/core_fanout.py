"""The engine-core process's side of its API servers: one pair of pipes per API server.

With `tandem serve --api-server-count N` (vLLM's flag) N API-server processes share the
listening socket and one engine core, so HTTP parsing, validation, tokenization and streaming
spread over N cores while the engine steps once for all of them. Here the commands of every API
server merge into the core's loop, and each step's EngineCoreOutputs is split: an API server gets
the outputs and failures of its own requests, the replies to its own utility calls, and the stats
snapshot with its own `num_added` (its admission control counts what it sent).

An API server that hangs up (STOP, or its pipe closes) has its requests aborted and their KV
blocks freed; the core stops when the last one has gone.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import pickle
import queue
import threading
from multiprocessing.connection import Connection, wait
from typing import Any

from tandem.engine.core import (
    ABORT,
    ADD,
    STOP,
    UTILITY,
    EngineCoreOutputs,
    EngineUnavailable,
)
from tandem.outputs import RequestOutput

logger = logging.getLogger("tandem.serve")

MAX_READS_PER_ITERATION = 64  # messages read from one API server's pipe per loop iteration


class CoreClients:
    """Commands in from, outputs out to, the API servers (client i: `commands[i]`, `outputs[i]`).

    `get_commands` is the core loop's command source; `send` is its output sink. Both run in the
    loop's thread, except the replies of background utilities (sent from their own thread): one
    lock guards the maps they share.
    """

    def __init__(self, commands: list[Connection], outputs: list[Connection]):
        if not commands or len(commands) != len(outputs):
            raise ValueError(
                f"need one output pipe per command pipe, got {len(commands)} and {len(outputs)}"
            )
        self.senders = [PipeSender(conn) for conn in outputs]
        self.live: dict[Connection, int] = {conn: i for i, conn in enumerate(commands)}
        self.owner: dict[str, int] = {}  # request id -> the API server that added it
        # requests whose prompt has crossed already: later outputs go without it (`_lean`)
        self.prompt_sent: set[str] = set()
        self.calls: dict[int, tuple[int, int]] = {}  # core call id -> (API server, its call id)
        self.num_added = [0] * len(commands)
        self._refused: list[list[tuple[str, BaseException]]] = [[] for _ in commands]
        self._call_ids = itertools.count()
        self._lock = threading.Lock()

    def start(self) -> None:
        for sender in self.senders:
            sender.start()

    def close(self) -> None:
        """Flush what was sent, then close every output pipe."""
        for sender in self.senders:
            sender.close()

    # -- commands in -----------------------------------------------------------------------------
    def get_commands(self, block: bool) -> list[tuple]:
        """What came in from any API server (waiting for something only if `block`); a STOP
        once none is left."""
        cmds: list[tuple] = []
        for conn in wait(list(self.live), timeout=None if block else 0):
            i = self.live[conn]
            hung_up = False
            try:
                for _ in range(MAX_READS_PER_ITERATION):  # a busy server does not starve the rest
                    batch = conn.recv()
                    with self._lock:
                        hung_up = self._accept(i, batch, cmds)
                    if hung_up or not conn.poll():
                        break
            except (EOFError, OSError):  # its process is gone
                hung_up = True
            if hung_up:
                with self._lock:
                    self._hang_up(conn, cmds)
        if any(self._refused):  # answered now: the loop sends nothing for an idle iteration
            self.send(EngineCoreOutputs())
        if not self.live:
            cmds.append((STOP,))
        return cmds

    def _accept(self, i: int, batch: list[tuple], cmds: list[tuple]) -> bool:
        """Append API server i's commands, translated to the core's ids; True at its STOP."""
        for cmd in batch:
            kind = cmd[0]
            if kind == ADD:
                rid = cmd[1]
                self.num_added[i] += cmd[3].n  # sequences, handled or refused: sent, as counted
                if rid in self.owner:  # ids are random per server: a clash is a caller's bug
                    error = EngineUnavailable(f"request id {rid!r} is already in flight")
                    self._refused[i].append((rid, error))
                    continue
                self.owner[rid] = i
                cmds.append(cmd)
            elif kind == ABORT:  # only its own requests
                mine = [rid for rid in cmd[1] if self.owner.get(rid) == i]
                for rid in mine:
                    del self.owner[rid]
                    self.prompt_sent.discard(rid)
                if mine:
                    cmds.append((ABORT, mine))
            elif kind == UTILITY:
                call_id = next(self._call_ids)
                self.calls[call_id] = (i, cmd[1])
                cmds.append((UTILITY, call_id, *cmd[2:]))
            elif kind == STOP:
                return True
            else:  # from an API server of another version, say: it must not stop the core
                logger.error("API server %d sent an unknown command %r; dropped", i, kind)
        return False

    def _hang_up(self, conn: Connection, cmds: list[tuple]) -> None:
        i = self.live.pop(conn)
        conn.close()
        self.senders[i].finish()  # nothing more goes to it; its reader sees end-of-file
        mine = [rid for rid, owner in self.owner.items() if owner == i]
        for rid in mine:
            del self.owner[rid]
            self.prompt_sent.discard(rid)
        for call_id in [c for c, (owner, _) in self.calls.items() if owner == i]:
            del self.calls[call_id]
        self._refused[i].clear()
        if mine:
            cmds.append((ABORT, mine))

    # -- outputs out -----------------------------------------------------------------------------
    def send(self, msg: EngineCoreOutputs) -> None:
        """Split one iteration's message by API server and queue each part for its pipe."""
        with self._lock:
            parts = [EngineCoreOutputs() for _ in self.senders]
            owner = self.owner
            for out in msg.outputs:
                i = owner.pop(out.request_id, None) if out.finished else owner.get(out.request_id)
                if i is not None:
                    parts[i].outputs.append(self._lean(out))
            for rid, error in msg.failed:
                self.prompt_sent.discard(rid)
                i = owner.pop(rid, None)
                if i is not None:
                    parts[i].failed.append((rid, error))
            for call_id, result, error in msg.replies:
                i, their_id = self.calls.pop(call_id, (None, 0))
                if i is not None:
                    parts[i].replies.append((their_id, result, error))
            for i, refused in enumerate(self._refused):
                if refused:
                    parts[i].failed += refused
                    refused.clear()
            live = set(self.live.values())
            for i, part in enumerate(parts):
                if msg.stats is not None:
                    part.stats = dataclasses.replace(msg.stats, num_added=self.num_added[i])
                if i in live and (part.stats or part.outputs or part.failed or part.replies):
                    self.senders[i].send(part)

    def _lean(self, out: RequestOutput) -> RequestOutput:
        """The output as it crosses: the prompt (text and ids) in a request's first output only.
        A streamed request sends tens of outputs, and its prompt was most of each pickle: at
        128 prompt tokens and --stream-interval 8, 77 -> 26 bytes per output token, pickling
        here 1.26 -> 0.33 us and unpickling in the API server 0.52 -> 0.29 us per output token
        (measured on a CPU). The API server's client puts the prompt back (`MPClient`).
        The engine keeps no reference to a RequestOutput it returned, so it is trimmed in place."""
        rid = out.request_id
        if rid not in self.prompt_sent:
            if not out.finished:
                self.prompt_sent.add(rid)
        else:
            out.prompt, out.prompt_token_ids = None, None
            if out.finished:
                self.prompt_sent.discard(rid)
        return out


class PipeSender:
    """Pickles and writes the core's messages from a thread of its own, first in first out.

    A pipe holds 64 KiB; a step's outputs for a few hundred streams are more. Written from the
    loop, a message waited there until the API server had read the previous one, so the engine
    stepped at the API server's pace. From this thread only the writer waits.
    """

    def __init__(self, conn):
        self.conn = conn
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="tandem-core-out", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def send(self, msg: EngineCoreOutputs) -> None:
        self.queue.put(portable_outputs(msg))

    def finish(self) -> None:
        """Write what is queued, then close the pipe (its reader sees end-of-file); no wait."""
        self.queue.put(None)

    def close(self, timeout_s: float = 30.0) -> None:
        self.finish()
        if self.thread.is_alive():
            self.thread.join(timeout_s)

    def _run(self) -> None:
        try:
            while (msg := self.queue.get()) is not None:
                self.conn.send(msg)
        except OSError:  # BrokenPipe, ConnectionReset: the API server is gone, and the loop
            pass  # learns it from its command pipe
        finally:
            self.conn.close()


def portable(e: BaseException) -> BaseException:
    """`e` if it survives pickling (most do), else the nearest builtin exception with its text:
    an error must reach the API process even when its class cannot."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001
        base = next(t for t in (ValueError, OSError, RuntimeError, Exception) if isinstance(e, t))
        return base(f"{type(e).__name__}: {e}")


def portable_outputs(msg: EngineCoreOutputs) -> EngineCoreOutputs:
    """`msg` with every error and reply made picklable (a reply that is not becomes an error)."""
    if msg.failed or msg.replies:
        msg.failed = [(rid, portable(e)) for rid, e in msg.failed]
        msg.replies = [_portable_reply(*reply) for reply in msg.replies]
    return msg


def _portable_reply(call_id: int, result: Any, error: BaseException | None) -> tuple:
    if error is not None:
        return call_id, None, portable(error)
    try:
        pickle.dumps(result)
    except Exception as e:  # noqa: BLE001
        return call_id, None, TypeError(f"the result cannot leave the engine process: {e}")
    return call_id, result, None
