"""Server mode: the trainer pushes weights to `tandem serve` over a collective group.

The trainer (rank 0) opens a TCPStore on a free port and asks the server (rank 1) to join a
two-party group through it (`POST /init_communicator`). Each update names its tensors
(`POST /update_named_params`: name, dtype, shape), the trainer broadcasts them, the engine thread
receives them into fresh buffers and loads them with `engine.load_weights` (which also resets the
prefix cache). The group is built from its own store, outside torch.distributed's default group,
so a trainer that already runs data parallel keeps its own world, and a server can close one
group and join another.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

from tandem.serve.async_engine import AsyncLLM, EngineUnavailable
from tandem.serve.errors import APIError

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


class InitCommunicatorRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    host: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)
    world_size: int = 2
    backend: Literal["nccl", "gloo"] = "nccl"
    timeout_s: float = Field(300.0, gt=0, le=24 * 3600)


class NamedParam(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=1024)
    dtype: str = Field(min_length=1, max_length=64)
    shape: list[int] = Field(max_length=16)


@dataclass
class _Spec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class _CommunicatorFailed(RuntimeError):
    """A broadcast failed (timeout, the trainer went away): the group is unusable."""


class WeightReceiver:
    """The server's side: at most one communicator, one operation on it at a time."""

    def __init__(self, llm: AsyncLLM):
        self.llm = llm
        self.comm: Communicator | None = None
        self._busy = asyncio.Lock()

    async def init(self, req: InitCommunicatorRequest) -> dict:
        if req.world_size != 2:
            raise APIError(
                f"world_size must be 2 (the trainer, rank {TRAINER_RANK}, and this server, rank "
                f"{SERVER_RANK}), got {req.world_size}",
                param="world_size",
            )
        device = self.llm.engine.device
        if req.backend == "nccl" and device.type != "cuda":
            raise APIError(
                f"backend 'nccl' needs an engine on a CUDA device; this one runs on {device.type}: "
                "use 'gloo'",
                param="backend",
            )
        async with self._exclusive("init_communicator"):
            if self.comm is not None:
                raise APIError(
                    "a communicator is open already; POST /close_communicator first",
                    409,
                    code="communicator_open",
                )
            try:  # the rendezvous waits for the trainer: off the event loop and the engine
                comm = await asyncio.to_thread(_join, req, device)
            except (RuntimeError, ValueError, OSError) as e:
                raise APIError(
                    f"could not join the trainer's group at {req.host}:{req.port} "
                    f"({req.backend}): {e}",
                    code="communicator_failed",
                ) from None
            try:
                await self.llm.call(lambda engine: comm.warmup())
            except EngineUnavailable as e:
                comm.close()
                raise APIError(str(e), 503, code="engine_unavailable") from None
            except RuntimeError as e:
                comm.close()
                raise APIError(
                    f"init_communicator: warm-up failed: {e}", 500, code="communicator_failed"
                ) from None
            self.comm = comm
        return {"status": "ok", "backend": req.backend, "rank": SERVER_RANK, "world_size": 2}

    async def update(self, params: list[NamedParam]) -> dict:
        """Receive the announced tensors by broadcast from the trainer and load them."""
        if not callable(getattr(self.llm.engine, "load_weights", None)):
            raise APIError("this engine has no load_weights()", 501, code="not_implemented")
        if not params:
            raise APIError("announce at least one tensor", param="params")
        specs = [_spec(i, p) for i, p in enumerate(params)]
        async with self._exclusive("update_named_params"):
            comm = self._require_comm()

            def receive_and_load(engine) -> int:
                # buffers first: a failure here is a plain refusal, the trainer sent nothing yet
                received = [
                    (s.name, torch.empty(s.shape, dtype=s.dtype, device=comm.device)) for s in specs
                ]
                try:
                    signal_ready(comm.store)
                    with comm.on_device():
                        for _, buf in received:
                            comm.broadcast(buf)
                except Exception as e:  # the group is out of step now
                    raise _CommunicatorFailed(f"{type(e).__name__}: {e}") from e
                return engine.load_weights(received)

            try:
                num = await self.llm.call(receive_and_load)
            except _CommunicatorFailed as e:
                self.comm = None
                comm.close()
                raise APIError(
                    f"receiving the weights failed, so the communicator is closed; init it again: "
                    f"{e}",
                    500,
                    code="communicator_failed",
                ) from None
            except EngineUnavailable as e:
                raise APIError(str(e), 503, code="engine_unavailable") from None
            except (ValueError, RuntimeError) as e:  # the group is in step and stays usable
                raise APIError(f"update_named_params: {e}", 400) from None
        return {
            "status": "ok",
            "num_tensors": num,
            "weights_version": getattr(self.llm.engine, "weights_version", None),
        }

    async def close(self) -> dict:
        async with self._exclusive("close_communicator"):
            comm, self.comm = self.comm, None
            if comm is None:
                return {"status": "ok", "closed": False}
            try:  # in the engine thread: after any receive queued before it
                await self.llm.call(lambda engine: comm.close())
            except EngineUnavailable:
                comm.close()
        return {"status": "ok", "closed": True}

    def _require_comm(self) -> Communicator:
        if self.comm is None:
            raise APIError(
                "no communicator: POST /init_communicator first",
                409,
                code="no_communicator",
            )
        return self.comm

    def _exclusive(self, what: str) -> asyncio.Lock:
        if self._busy.locked():
            raise APIError(
                f"{what}: another communicator operation is in progress", 409, code="busy"
            )
        return self._busy


def _join(req: InitCommunicatorRequest, device: torch.device) -> Communicator:
    store = open_store(req.host, req.port, False, req.timeout_s)
    signal_ready(store)
    return Communicator(store, SERVER_RANK, 2, req.backend, req.timeout_s, device)


def _spec(i: int, p: NamedParam) -> _Spec:
    dtype = getattr(torch, p.dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise APIError(f"params.{i}.dtype: {p.dtype!r} is not a torch dtype", param="dtype")
    if any(d < 0 for d in p.shape):
        raise APIError(f"params.{i}.shape: negative size in {p.shape}", param="shape")
    return _Spec(p.name, dtype, tuple(p.shape))
