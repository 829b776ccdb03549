"""The two-party collective group over which a trainer pushes weights to `tandem serve`.

The trainer (rank 0) opens a TCPStore on a free port and asks the server (rank 1) to join a
two-party group through it. The group is built from its own store, outside torch.distributed's
default group, so a trainer that already runs data parallel keeps its own world, and a server can
close one group and join another. Both sides use this module: the trainer in
`tandem.rl.server_client`, the server in its engine core (`tandem.weights.receiver`).
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist

TRAINER_RANK = 0
SERVER_RANK = 1
_PREFIX = "tandem-weights"
_READY = _PREFIX + "/ready"  # how many collective steps the server has entered


def open_store(host: str, port: int, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """The group's rendezvous: the master (the trainer) listens, `port=0` taking any free port
    (read it back from `.port`); the other rank connects to host:port."""
    return dist.TCPStore(
        host,
        port,
        2,
        is_master=is_master,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def signal_ready(store: dist.Store) -> None:
    """The server says it enters its next collective step (join, or the receive of an update)."""
    store.add(_READY, 1)


def steps_entered(store: dist.Store) -> int:
    return store.add(_READY, 0)


def wait_ready(
    store: dist.Store, count: int, refused: Callable[[], bool], timeout_s: float
) -> bool:
    """The trainer waits until the server has entered collective step `count` (True) or
    `refused()` (False): a refused request never leaves the trainer stuck in a collective."""
    deadline = time.monotonic() + timeout_s
    while steps_entered(store) < count:
        if refused():
            return False
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server did not start collective step {count} in {timeout_s} s")
        time.sleep(0.002)
    return True


class Communicator:
    """A process group of its own, built from `store` (not torch.distributed's default group).

    Construction blocks until every rank has joined. Tensors travel as their bytes, so every
    dtype crosses gloo and NCCL alike.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        backend: Literal["gloo", "nccl"],
        timeout_s: float,
        device: torch.device | None = None,
    ):
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.store = store  # kept alive with the group
        prefixed = dist.PrefixStore(_PREFIX, store)
        if backend == "gloo":
            self.device = torch.device("cpu")
            self.group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        elif backend == "nccl":
            self.device = torch.device(device) if device is not None else torch.device("cuda")
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        else:
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")

    def broadcast(self, tensor: torch.Tensor, src: int = TRAINER_RANK) -> None:
        """Broadcast a contiguous tensor in place from rank `src` (blocks until it is sent or
        received; for NCCL, until the current stream is ordered after it)."""
        if tensor.numel() == 0:
            return
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.group.broadcast([tensor.reshape(-1).view(torch.uint8)], opts).wait()

    def on_device(self):
        """A context with the group's CUDA device current (a no-op for gloo)."""
        if self.device.type == "cuda":
            return torch.cuda.device(self.device)
        return contextlib.nullcontext()

    def warmup(self) -> None:
        """One small broadcast: proves the link works and makes NCCL build its communicator now
        rather than inside the first update."""
        with self.on_device():
            t = torch.full((1,), 7 if self.rank == TRAINER_RANK else 0, device=self.device)
            self.broadcast(t)
            if int(t.item()) != 7:
                raise RuntimeError("the communicator's warm-up broadcast carried the wrong value")

    def close(self) -> None:
        group, self.group, self.store = self.group, None, None
        shutdown = getattr(group, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except RuntimeError:
                pass  # a group that failed is torn down already
