"""Spawned tensor-parallel ranks for `LLM(..., tensor_parallel_size=N)` used with no process group.

The process that builds the LLM (the driver) becomes rank 0 and starts ranks 1..N-1 (forked while
CUDA is not initialised in it, as vLLM does, so an unguarded plain script works; spawned after,
with a warning saying how to guard the script: `start_method`). Every rank
builds the same engine and runs every call the driver mirrors to it (generate, sleep, wake_up,
reset_prefix_cache): SPMD, as under torchrun. Same inputs, same seeds and all-gathered logits give
every rank the same scheduler decisions and the same sampled tokens, so the model's collectives
always line up. Calls travel with `broadcast_object_list` on a gloo side group.

Rendezvous is a FileStore in a fresh temporary directory: no port, no fixed name, so engines never
collide. An in-memory HF model is saved (safetensors) into that directory and every rank, the
driver included, loads it from there: all ranks build the engine the same way, nothing on a GPU is
pickled, and the directory is removed once every rank has loaded it.

Weight updates (load_weights / update_weights_from_model) are not mirrored: colocated RL runs one
process per rank under torchrun, where every rank makes the call itself.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import threading
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

MIRRORED = ("generate", "sleep", "wake_up", "reset_prefix_cache")
# A worker waits for the driver's next call for as long as the LLM lives.
_IDLE_TIMEOUT = timedelta(days=365)
_STARTUP_TIMEOUT_S = 600.0
_TEARDOWN_TIMEOUT_S = 30.0
# Drivers alive in this process: their world is torch.distributed's one default group.
_DRIVERS: weakref.WeakSet = weakref.WeakSet()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _rank_device(device: torch.device, rank: int) -> str:
    return "cpu" if device.type == "cpu" else f"cuda:{device.index + rank}"


def start_workers(config, hf_model=None, tokenizer=None, llm_cls=None):
    """The LLM's hook: spawn ranks 1..N-1 when tensor_parallel_size > 1 and no process group exists.
    Each rank builds `llm_cls(**config)` (the caller's class, passed in so that this module does
    not import the LLM that imports it) and runs the calls the driver mirrors to it.

    Returns (workers or None, the model the driver's engine should take). Under torchrun (a
    process group exists) it does nothing: each process is one rank already. `config` is made
    explicit (model path, dtype, device) so that every rank resolves it alike.
    """
    tp = config.tensor_parallel_size
    if tp == 1:
        return None, hf_model
    if dist.is_initialized():
        if any(not d.closed for d in _DRIVERS):
            raise RuntimeError(
                "an LLM that spawned tensor-parallel workers is alive in this process and owns its "
                "process group; call its tp_workers.shutdown() before building another"
            )
        return None, hf_model
    from tandem.engine.memory import resolve_device, resolve_dtype
    from tandem.models.loader import resolve_model
    from tandem.parallel.tensor_parallel import validate_tp

    source = resolve_model(hf_model if hf_model is not None else config.model, config.load_format,
                           config.trust_remote_code, config.revision)
    validate_tp(source.hf_config, tp)  # fail before spawning anything
    if hf_model is None and source.path is not None:
        config.model = source.path  # a hub id resolved once, here; the ranks read the snapshot
    # Before the ranks start, CUDA must stay uninitialised here for them to be forked
    # (resolve_device's current_device() would initialise it).
    if hf_model is None:
        device = device_without_cuda_init(config.device)
    else:
        device = resolve_device(config.device, hf_model)
    if device.type == "cuda" and device.index + tp > torch.cuda.device_count():
        raise ValueError(
            f"tensor_parallel_size={tp} on {device} needs GPUs {device.index}.."
            f"{device.index + tp - 1}, but only {torch.cuda.device_count()} are visible"
        )
    config.dtype = _dtype_name(resolve_dtype(config.dtype, source.hf_config, device, hf_model))
    config.device = _rank_device(device, 0)
    tmpdir = tempfile.mkdtemp(prefix="tandem-tp-")
    try:
        if hf_model is not None:
            model_dir = os.path.join(tmpdir, "model")
            hf_model.save_pretrained(model_dir, safe_serialization=True)
            config.model = model_dir
            if config.tokenizer is None and tokenizer is None:
                config.tokenizer = source.tokenizer_path
        backend = "nccl" if device.type == "cuda" else "gloo"
        init_method = "file://" + os.path.join(tmpdir, "rendezvous")
        method = start_method()
        ctx = torch.multiprocessing.get_context(method)
        procs, ready = [], []
        for rank in range(1, tp):
            ev = ctx.Event()
            cfg = dataclasses.replace(config, device=_rank_device(device, rank))
            args = (rank, tp, backend, init_method, cfg, tokenizer, ev, llm_cls)
            p = ctx.Process(target=worker_main, args=args, name=f"tandem-tp{rank}", daemon=True)
            p.start()
            procs.append(p)
            ready.append(ev)
        state = _DriverState(procs, tmpdir)
        _DRIVERS.add(state)
        _wait_ready(procs, ready, method)
        dist.init_process_group(backend, init_method=init_method, rank=0, world_size=tp,
                                timeout=timedelta(seconds=_STARTUP_TIMEOUT_S))
        state.owns_world = True
        state.side = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    except BaseException:
        if "state" in locals():
            state.close()
        else:
            shutil.rmtree(tmpdir, ignore_errors=True)
        raise
    return TPWorkers(state), None


def device_without_cuda_init(device: str) -> torch.device:
    """resolve_device for a model named by path, without creating a CUDA context."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} asked for, but no CUDA GPU is available; use 'cpu' or 'auto'")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_initialized() else 0)
    return dev


def start_method() -> str:
    """fork while CUDA is not initialised here (a plain script, unguarded, works: the ranks do not
    re-run it), spawn once it is (CUDA cannot be forked), as vLLM does. TANDEM_WORKER_START_METHOD
    (fork | spawn) overrides."""
    forced = os.environ.get("TANDEM_WORKER_START_METHOD")
    if forced:
        if forced not in ("fork", "spawn"):
            raise ValueError(f"TANDEM_WORKER_START_METHOD must be 'fork' or 'spawn', got {forced!r}")
        return forced
    if not torch.cuda.is_initialized():
        return "fork"
    logger.warning(
        "CUDA is initialised in this process, so the tensor-parallel ranks start with 'spawn', "
        "which re-imports the main script: a script that builds LLM(...) at module level must do "
        "it under `if __name__ == \"__main__\":` (or build the LLM before touching CUDA)")
    return "spawn"


def _wait_ready(procs, ready, method: str = "fork") -> None:
    deadline = time.monotonic() + _STARTUP_TIMEOUT_S
    for rank, (p, ev) in enumerate(zip(procs, ready), start=1):
        while not ev.wait(0.2):
            if not p.is_alive():
                hint = ("; it was spawned, so it re-imported the main script: build the LLM under "
                        "`if __name__ == \"__main__\":`" if method == "spawn" else "")
                raise RuntimeError(f"tensor-parallel rank {rank} exited (code {p.exitcode}) while "
                                   f"starting; its traceback is on stderr{hint}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"tensor-parallel rank {rank} did not start in {_STARTUP_TIMEOUT_S:.0f} s"
                )


def _destroy_bounded(timeout_s: float = _TEARDOWN_TIMEOUT_S) -> None:
    """destroy_process_group, given up on after `timeout_s`: a communicator teardown that does not
    return must not hang a process that is done with it (on 2 H200s a TP=2 `bench throughput`
    did not exit after its profile; teardown is the suspect, unconfirmed)."""
    t = threading.Thread(target=dist.destroy_process_group, name="tandem-tp-teardown", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        logger.warning("tensor-parallel process group teardown did not finish in %.0f s; leaving it",
                       timeout_s)


class _DriverState:
    """What the driver must release: worker processes, process groups, the temporary directory.
    Kept apart from TPWorkers so a finalizer can close it without keeping TPWorkers alive."""

    def __init__(self, procs, tmpdir: str):
        self.procs = procs
        self.tmpdir: str | None = tmpdir
        self.side = None
        self.owns_world = False
        self.synced = False  # every rank has built its engine
        self.closed = False
        self.runner_ref = None  # weakref to the driver's ModelRunner (its graphs hold the comm)

    def sync(self) -> None:
        """First call after construction: wait for every rank's engine, then drop the temp dir."""
        if not self.synced:
            dist.barrier(group=self.side)
            self.synced = True
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        sender = None
        if self.synced and all(p.is_alive() for p in self.procs):
            # In a thread: a rank stuck elsewhere (interrupted generate) must not hang the driver.
            sender = threading.Thread(target=self._send_shutdown, daemon=True)
            sender.start()
            sender.join(timeout=30)
            # The ranks now tear down their process groups. NCCL's teardown can wait for every
            # rank's (on 2 H200s a worker sat in it until killed), so the driver tears its own
            # down now, beside theirs, not after joining them.
            self._destroy_world()
            for p in self.procs:
                p.join(timeout=30)
        for p in self.procs:  # not yet in their loop (or stuck): no graceful way out
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        if sender is not None:
            sender.join(timeout=5)
        self._destroy_world()
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)

    def _destroy_world(self) -> None:
        if self.owns_world and dist.is_initialized():
            runner = self.runner_ref() if self.runner_ref is not None else None
            if runner is not None:
                runner.release_cudagraphs()
            _destroy_bounded()

    def _send_shutdown(self) -> None:
        try:
            dist.broadcast_object_list([("shutdown", ())], src=0, group=self.side)
        except Exception:  # a rank already gone; close() terminates the rest
            logger.warning("tensor-parallel workers did not take the shutdown call", exc_info=True)


class TPWorkers:
    """The driver's handle on its spawned ranks: `mirror` makes every rank run the same call."""

    def __init__(self, state: _DriverState):
        self._state = state
        self._finalizer = weakref.finalize(self, state.close)

    @property
    def num_workers(self) -> int:
        return len(self._state.procs)

    def mirror(self, method: str, *args) -> None:
        """Have ranks 1..N-1 call `LLM.<method>(*args)`; the driver then makes the call itself."""
        if method not in MIRRORED:
            raise NotImplementedError(
                f"{method}() on an LLM whose tensor-parallel ranks it spawned itself is not "
                "supported; run one process per rank (torchrun, tensor_parallel_size=N on each) "
                "and make the call on every rank"
            )
        if self._state.closed:
            raise RuntimeError("this LLM's tensor-parallel workers were shut down")
        self._state.sync()
        dist.broadcast_object_list([(method, args)], src=0, group=self._state.side)

    def attach(self, model_runner) -> None:
        """The driver's own runner: its CUDA graphs are dropped before the process group, since
        NCCL's communicator teardown waits until every graph that captured a collective is gone."""
        self._state.runner_ref = weakref.ref(model_runner)

    def shutdown(self) -> None:
        """Stop the workers and release the process groups (also runs when the LLM is collected)."""
        self._finalizer()


def worker_main(
    rank: int, world_size: int, backend: str, init_method: str, config, tokenizer, ready, llm_cls
) -> None:
    """A spawned rank: build the same LLM as the driver, then run the calls it broadcasts."""
    if config.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(config.device))
    else:  # share the host's cores with the other ranks instead of oversubscribing them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    ready.set()
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=_STARTUP_TIMEOUT_S))
    side = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    kwargs = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    if tokenizer is not None:
        kwargs["tokenizer"] = tokenizer
    llm = llm_cls(**kwargs)
    dist.barrier(group=side)  # matches the driver's sync(): every engine is built
    while True:
        msg = [None]
        dist.broadcast_object_list(msg, src=0, group=side)
        method, args = msg[0]
        if method == "shutdown":
            break
        if method == "generate":
            args = (*args, False)  # use_tqdm: only the driver shows progress
        try:
            getattr(llm, method)(*args)
        except Exception:
            # The driver ran the same checks on the same input and raised the same error.
            logger.debug("rank %d: %s raised", rank, method, exc_info=True)
    llm.llm_engine.worker.model_runner.release_cudagraphs()  # NCCL's teardown waits for graphs using it
    del llm
    _destroy_bounded()
