"""EngineCore: the LLMEngine and the loop that steps it, wherever the engine lives.

The same core runs in a thread of the API process (`--engine-mode thread`) or in a process of its
own (`--engine-mode process`, vLLM V1's EngineCoreProc; see `run_engine_core`). Commands come in
as tuples; each iteration of the loop sends one EngineCoreOutputs carrying every output of the
step, the replies to utility calls and a fresh stats snapshot, so the API side handles one
message per step, not one per token.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import logging
import os
import pickle
import queue
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.config import EngineConfig
from tandem.engine.gc_pause import freeze_for_good
from tandem.engine.llm_engine import LLMEngine
from tandem.outputs import RequestOutput
from tandem.serve.metrics import EngineStats
from tandem.serve.weight_sync import WeightSyncWorker

logger = logging.getLogger("tandem.serve")

# Commands, as tuples whose first item names them:
ADD = "add"  # (ADD, request_id, prompt, params, output_kind)
ABORT = "abort"  # (ABORT, [request_id, ...])
UTILITY = "utility"  # (UTILITY, call_id, method, args): a method of EngineCore, replied to
STOP = "stop"  # (STOP,): abort what is in flight and leave the loop

# Methods a UTILITY command may name (nothing else of the core is reachable from outside).
UTILITIES = frozenset(
    {
        "call",
        "call_engine",
        "load_weights_from",
        "join_communicator",
        "warmup_communicator",
        "update_named_params",
        "close_communicator",
    }
)


class EngineError(RuntimeError):
    """The engine failed while running a request (its step raised); the request is gone."""


class EngineUnavailable(RuntimeError):
    """The engine refused or dropped the request through no fault of it: asleep, without valid
    weights, shutting down, or gone."""


class EngineBusy(RuntimeError):
    """An admin call that needs an idle engine found requests in flight."""


class InvalidWeights(ValueError):
    """An /update_weights body that is not a safetensors file."""


@dataclass(frozen=True)
class EngineInfo:
    """What the API process learns once, at start-up: the limits it checks requests against
    before they cross, and its own copy of the tokenizer (prompts, chat templates)."""

    max_model_len: int
    vocab_size: int
    tokenizer: Any
    device: str  # "cpu", "cuda:0", ...


@dataclass
class EngineCoreOutputs:
    """One iteration of the core's loop: outputs of its step, requests it failed, replies to
    utility calls (call_id, result, error). `stats` is None for a reply sent from a background
    thread (it cannot read the engine's state safely)."""

    outputs: list[RequestOutput] = field(default_factory=list)
    stats: EngineStats | None = None
    failed: list[tuple[str, BaseException]] = field(default_factory=list)
    replies: list[tuple[int, Any, BaseException | None]] = field(default_factory=list)


class EngineCore:
    """Owns one LLMEngine; `run_busy_loop` applies commands and steps it; `send` ships the
    results (a direct call in thread mode, a pipe in process mode)."""

    def __init__(self, engine: LLMEngine, send: Callable[[EngineCoreOutputs], None]):
        self.engine = engine
        self.weight_sync = WeightSyncWorker(engine)
        self._send = send
        self._send_lock = threading.Lock()  # background utilities reply from their own thread
        self._num_added = 0

    def info(self) -> EngineInfo:
        tok = self.engine.tokenizer
        return EngineInfo(
            max_model_len=self.engine.max_model_len,
            vocab_size=self.engine.hf_config.vocab_size,
            # a private copy: HF tokenizers are not safe to share with the detokenizing loop
            tokenizer=copy.deepcopy(tok) if tok is not None else None,
            device=str(self.engine.device),
        )

    def send(self, msg: EngineCoreOutputs) -> None:
        with self._send_lock:
            self._send(msg)

    # -- the loop --------------------------------------------------------------------------------
    def run_busy_loop(self, get_commands: Callable[[bool], list[tuple]]) -> None:
        """Until a STOP: apply the commands that came in, step if there is work, send what the
        step produced. `get_commands(block)` blocks only when the engine is idle (no spin)."""
        engine = self.engine
        while True:
            cmds = get_commands(not engine.has_unfinished_requests())
            msg = EngineCoreOutputs()
            stop = False
            for cmd in cmds:
                if cmd[0] == STOP:
                    stop = True
                else:
                    self._apply(cmd, msg)
            if stop:  # what is in flight is aborted; the API side fails its callers
                engine.abort_request(list(engine.requests))
                return
            stepped = engine.has_unfinished_requests()
            if stepped:
                try:
                    msg.outputs = engine.step()
                except Exception as e:  # a bug or an impossible batch: fail its requests, live on
                    logger.exception(
                        "engine step failed; aborting %d requests", len(engine.requests)
                    )
                    error = EngineError(f"the engine failed: {type(e).__name__}: {e}")
                    msg.failed += [(rid, error) for rid in engine.requests]
                    engine.abort_request(list(engine.requests))  # frees their blocks
            if cmds or stepped:
                msg.stats = self.snapshot()
                self.send(msg)

    def _apply(self, cmd: tuple, msg: EngineCoreOutputs) -> None:
        kind = cmd[0]
        if kind == ADD:
            _, rid, prompt, params, output_kind = cmd
            self._num_added += 1
            try:
                self.engine.add_request(rid, prompt, params, output_kind)
            except ValueError as e:  # the input was checked before: the engine's state refused it
                msg.failed.append((rid, EngineUnavailable(str(e))))
        elif kind == ABORT:
            self.engine.abort_request(cmd[1])
        elif kind == UTILITY:
            _, call_id, method, args = cmd
            try:
                if method not in UTILITIES:
                    raise AttributeError(f"the engine core has no utility {method!r}")
                result = getattr(self, method)(*args)
            except Exception as e:  # noqa: BLE001 (re-raised in the caller's task)
                msg.replies.append((call_id, None, e))
                return
            if isinstance(result, cf.Future):  # runs on in the background: reply when done
                result.add_done_callback(lambda f: self._reply_later(call_id, f))
            else:
                msg.replies.append((call_id, result, None))
        else:
            raise ValueError(f"unknown engine-core command {kind!r}")

    def _reply_later(self, call_id: int, fut: cf.Future) -> None:
        error = fut.exception()
        reply = (call_id, None if error else fut.result(), error)
        self.send(EngineCoreOutputs(replies=[reply]))

    def snapshot(self) -> EngineStats:
        engine, sched, bm = self.engine, self.engine.scheduler, self.engine.block_manager
        running = {s.request_id for s in sched.running}
        waiting = {s.request_id for s in sched.waiting} - running
        return EngineStats(
            num_running=len(running),
            num_waiting=len(waiting),
            num_added=self._num_added,
            num_unfinished=engine.get_num_unfinished_requests(),
            kv_cache_usage=bm.usage,
            num_blocks=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks,
            prefix_queries=bm.num_prefix_queries,
            prefix_hits=bm.num_prefix_hits,
            num_preemptions=sched.num_preemptions,
            generation_tokens=engine.num_generated_tokens,
            is_sleeping=bool(getattr(engine, "is_sleeping", False)),
            weights_version=getattr(engine, "weights_version", 0),
            step_stats={k: (n, sec) for k, (n, sec) in engine.step_stats.items()},
        )

    # -- utilities (UTILITY commands), run between two steps -------------------------------------
    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(engine, *args)`, collective_rpc-style. In process mode `fn` travels by pickle, so
        it must be a module-level function."""
        return fn(self.engine, *args)

    def call_engine(self, method: str, args: tuple = (), idle: bool = False) -> Any:
        """`engine.method(*args)`; with `idle`, only when no request is in flight."""
        fn = getattr(self.engine, method, None)
        if not callable(fn):
            raise NotImplementedError(f"this engine has no {method}()")
        if idle and self.engine.has_unfinished_requests():
            raise EngineBusy(
                f"{self.engine.get_num_unfinished_requests()} requests are in flight; "
                f"{method} waits for an idle engine"
            )
        return fn(*args)

    def load_weights_from(self, kind: str, source: str | bytes) -> int:
        """Load a checkpoint directory (`kind="path"`) or safetensors bytes (`"safetensors"`),
        parsed here, where the weights live, so they cross between processes once."""
        if kind == "path":
            from tandem.models.loader import iterate_checkpoint

            return self.engine.load_weights(iterate_checkpoint(source))
        from safetensors import SafetensorError
        from safetensors.torch import load

        try:
            tensors = load(source)
        except SafetensorError as e:
            raise InvalidWeights(f"the body is not a safetensors file: {e}") from None
        return self.engine.load_weights(iter(tensors.items()))

    def join_communicator(self, host: str, port: int, backend: str, timeout_s: float) -> cf.Future:
        return self.weight_sync.join(host, port, backend, timeout_s)

    def warmup_communicator(self) -> None:
        self.weight_sync.warmup()

    def update_named_params(self, specs: list) -> int:
        return self.weight_sync.receive_and_load(specs)

    def close_communicator(self) -> bool:
        return self.weight_sync.close()


# -- the engine-core process ---------------------------------------------------------------------
def run_engine_core(config: EngineConfig, commands, outputs, log_level: str = "INFO") -> None:
    """Entry point of the engine-core process: build the engine, say ready (or why not), then
    run the loop until a STOP or until the API process goes away (its pipe closes).

    SIGINT and SIGTERM are ignored here: a Ctrl-C in a terminal reaches the whole process group,
    and the engine must keep stepping while the API process drains in-flight requests; it stops
    when told to, or when the API process is gone.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s (engine core): %(message)s")
    _leave_a_core_to_the_api_process()
    try:
        engine = LLMEngine(config)
    except Exception as e:
        logger.exception("building the engine failed")
        outputs.send(("failed", portable(e)))
        return
    sender = PipeSender(outputs)
    core = EngineCore(engine, sender.send)
    outputs.send(("ready", core.info()))
    sender.start()
    freeze_for_good()  # this process lives for its engine: full GC passes skip the start-up heap

    def get_commands(block: bool) -> list[tuple]:
        cmds: list[tuple] = []
        try:
            if block:
                cmds += commands.recv()
            while commands.poll():
                cmds += commands.recv()
        except (EOFError, OSError):  # the API process is gone: nobody to serve
            cmds.append((STOP,))
        return cmds

    try:
        core.run_busy_loop(get_commands)
    finally:
        sender.close()  # what the last iterations sent (aborted requests' failures) goes out first
        core.weight_sync.close()


class PipeSender:
    """Pickles and writes the core's messages from a thread of its own, first in first out.

    A pipe holds 64 KiB; a step's outputs for a few hundred streams are more. Written from the
    loop, a message waited there until the API process had read the previous one, so the engine
    stepped at the API process's pace. From this thread only the writer waits.
    """

    def __init__(self, conn):
        self.conn = conn
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="tandem-core-out", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def send(self, msg: EngineCoreOutputs) -> None:
        self.queue.put(portable_outputs(msg))

    def close(self, timeout_s: float = 30.0) -> None:
        self.queue.put(None)
        if self.thread.is_alive():
            self.thread.join(timeout_s)

    def _run(self) -> None:
        try:
            while (msg := self.queue.get()) is not None:
                self.conn.send(msg)
        except OSError:  # BrokenPipe, ConnectionReset: the API process is gone, and the loop
            pass  # learns it from its command pipe


def _leave_a_core_to_the_api_process() -> None:
    """Intra-op threads: all cores but one, unless OMP_NUM_THREADS says otherwise (vLLM's
    workers do the like). With every core, the pool's spinning threads starve the API process
    and, waiting at their barriers for a descheduled peer, the engine itself: measured on a
    2-core CPU box, a step took 10-40x longer."""
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(max(1, (cores or 1) - 1))


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
