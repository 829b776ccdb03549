"""The engine side of the trainer's weight push: it holds the communicator, receives the
broadcast tensors and loads them. It lives where the weights live (the engine core: the engine
process in process mode); the HTTP side is `tandem.serve.weight_receiver`.

Joining waits for the trainer's rendezvous, so it runs in a thread of its own and the engine keeps
stepping meanwhile; warm-up, receive and close run in the engine loop, between two steps.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from dataclasses import dataclass

import torch

from tandem.weights.check import check_weights
from tandem.weights.communicator import SERVER_RANK, Communicator, open_store, signal_ready


@dataclass(frozen=True)
class TensorSpec:
    """One announced tensor: what to allocate before the trainer's broadcast fills it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class CommunicatorFailed(RuntimeError):
    """A broadcast failed (timeout, the trainer went away): the group is unusable and closed."""


class WeightSyncWorker:
    """At most one communicator; the HTTP side serializes the operations on it."""

    def __init__(self, engine):
        self.engine = engine
        self.comm: Communicator | None = None
        self._lock = threading.Lock()  # the join thread hands its group over under it

    def join(self, host: str, port: int, backend: str, timeout_s: float) -> cf.Future:
        """Join the trainer's group as rank 1, in a thread (the rendezvous waits for the
        trainer); the future completes when the group is built."""
        if self.comm is not None:
            raise RuntimeError("a communicator is open already")
        fut: cf.Future = cf.Future()
        device = self.engine.device

        def run() -> None:
            try:
                store = open_store(host, port, False, timeout_s)
                signal_ready(store)
                comm = Communicator(store, SERVER_RANK, 2, backend, timeout_s, device)
            except Exception as e:  # noqa: BLE001 (re-raised in the caller's task)
                fut.set_exception(e)
                return
            with self._lock:
                self.comm = comm
            fut.set_result(None)

        threading.Thread(target=run, name="tandem-join-communicator", daemon=True).start()
        return fut

    def warmup(self) -> None:
        """One small broadcast through the new group; a failure closes it."""
        comm = self._require()
        try:
            comm.warmup()
        except Exception:
            self.close()
            raise

    def receive_and_load(self, specs: list[TensorSpec]) -> int:
        """Receive the announced tensors, broadcast by the trainer in this order, and load them
        (load_weights also resets the prefix cache: cached KV came from the old weights)."""
        comm = self._require()
        # checks and buffers first: a failure here is a plain refusal, the trainer sent nothing
        # yet, and nothing is loaded unless every tensor fits (asleep, parameters have no shapes)
        if not self.engine.worker.weight_store.resident:
            self.engine.wake_up(["weights"])
        check_weights(self.engine.model, [(s.name, s.shape, s.dtype) for s in specs])
        received = [
            (s.name, torch.empty(s.shape, dtype=s.dtype, device=comm.device)) for s in specs
        ]
        try:
            signal_ready(comm.store)
            with comm.on_device():
                for _, buf in received:
                    comm.broadcast(buf)
        except Exception as e:  # noqa: BLE001 (the group is out of step now)
            self.close()
            raise CommunicatorFailed(f"{type(e).__name__}: {e}") from None
        return self.engine.load_weights(received)

    def close(self) -> bool:
        """Close the group; False if none was open."""
        with self._lock:
            comm, self.comm = self.comm, None
        if comm is None:
            return False
        comm.close()
        return True

    def _require(self) -> Communicator:
        with self._lock:
            comm = self.comm
        if comm is None:
            raise RuntimeError("no communicator: POST /init_communicator first")
        return comm
