"""EngineCore: the LLMEngine and the loop that steps it, wherever the engine lives.

The same core runs in a thread of the API process (`--engine-mode thread`) or in a process of its
own (`--engine-mode process`, vLLM V1's EngineCoreProc; see `engine_core_proc`). Commands come in
as tuples; each iteration of the loop sends one EngineCoreOutputs carrying every output of the
step, the replies to utility calls and a stats snapshot (`STATS_INTERVAL_S`), so the API side
handles one message per step, not one per token.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import logging
import operator
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.llm_engine import LLMEngine
from tandem.engine.metrics import EngineStats
from tandem.outputs import RequestOutput
from tandem.weights.receiver import WeightSyncWorker

logger = logging.getLogger("tandem.serve")
_request_id = operator.attrgetter("request_id")

# Commands, as tuples whose first item names them:
ADD = "add"  # (ADD, request_id, prompt, params, output_kind)
ABORT = "abort"  # (ABORT, [request_id, ...])
UTILITY = "utility"  # (UTILITY, call_id, method, args): a method of EngineCore, replied to
STOP = "stop"  # (STOP,): abort what is in flight and leave the loop

# How stale the API side's EngineStats may grow while the engine steps without commands
# (admission control and /metrics read them; each command and each idle engine sends fresh ones).
STATS_INTERVAL_S = 0.01

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
    host_only: bool = False  # EngineConfig.host_only: requests that need logits are refused


@dataclass
class EngineCoreOutputs:
    """One iteration of the core's loop: outputs of its step, requests it failed, replies to
    utility calls (call_id, result, error). `stats` is None when the last snapshot is still
    fresh (`STATS_INTERVAL_S`) and for a reply sent from a background thread (it cannot read the
    engine's state safely)."""

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
            host_only=self.engine.config.host_only,
        )

    def send(self, msg: EngineCoreOutputs) -> None:
        with self._send_lock:
            self._send(msg)

    # -- the loop --------------------------------------------------------------------------------
    def run_busy_loop(self, get_commands: Callable[[bool], list[tuple]]) -> None:
        """Until a STOP: apply the commands that came in, step if there is work, send what the
        step produced. `get_commands(block)` blocks only when the engine is idle (no spin)."""
        engine = self.engine
        next_stats = 0.0
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
                now = time.monotonic()
                # a snapshot walks the queues (tens of us at a thousand requests): every step
                # that took commands or left the engine idle, else once per STATS_INTERVAL_S
                if cmds or now >= next_stats or not engine.has_unfinished_requests():
                    msg.stats = self.snapshot()
                    next_stats = now + STATS_INTERVAL_S
                self.send(msg)

    def _apply(self, cmd: tuple, msg: EngineCoreOutputs) -> None:
        kind = cmd[0]
        if kind == ADD:
            _, rid, prompt, params, output_kind = cmd
            self._num_added += params.n
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
        # (every step: map over attrgetter runs in C, a comprehension in the interpreter)
        running = set(map(_request_id, sched.running))
        waiting = set(map(_request_id, sched.waiting)) - running
        return EngineStats(
            num_running=len(running),
            num_waiting=len(waiting),
            num_waiting_seqs=len(sched.waiting),
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
            from tandem.weights.check import checkpoint_specs

            specs = checkpoint_specs(source) if os.path.isdir(source) else None
            return self.engine.load_weights(iterate_checkpoint(source), specs)
        from safetensors import SafetensorError
        from safetensors.torch import load

        try:
            tensors = load(source)
        except SafetensorError as e:
            raise InvalidWeights(f"the body is not a safetensors file: {e}") from None
        return self.engine.load_weights(list(tensors.items()))  # a list: checked whole first

    def join_communicator(self, host: str, port: int, backend: str, timeout_s: float) -> cf.Future:
        return self.weight_sync.join(host, port, backend, timeout_s)

    def warmup_communicator(self) -> None:
        self.weight_sync.warmup()

    def update_named_params(self, specs: list) -> int:
        return self.weight_sync.receive_and_load(specs)

    def close_communicator(self) -> bool:
        return self.weight_sync.close()
