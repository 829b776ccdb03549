"""Server mode, the HTTP side: the admin routes through which a trainer pushes weights to
`tandem serve` over a collective group (`tandem.weights.communicator`).

The trainer asks the server to join its two-party group (`POST /init_communicator`); each update
names its tensors (`POST /update_named_params`: name, dtype, shape), the trainer broadcasts them,
and the engine core receives them into fresh buffers and loads them (`tandem.weights.receiver`,
in the engine process, where the weights live). Here requests are checked, one operation runs at
a time, and the engine core's errors become HTTP answers.
"""

from __future__ import annotations

import asyncio
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from tandem.engine.async_llm import AsyncLLM, EngineUnavailable
from tandem.serve.errors import APIError
from tandem.weights.communicator import SERVER_RANK, TRAINER_RANK
from tandem.weights.receiver import CommunicatorFailed, TensorSpec


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


class WeightReceiver:
    """The server's side: at most one communicator (held by the engine core), one operation on
    it at a time."""

    def __init__(self, llm: AsyncLLM):
        self.llm = llm
        self.is_open = False  # mirrors the engine core's communicator: only we open and close it
        self._busy = asyncio.Lock()

    async def init(self, req: InitCommunicatorRequest) -> dict:
        if req.world_size != 2:
            raise APIError(
                f"world_size must be 2 (the trainer, rank {TRAINER_RANK}, and this server, rank "
                f"{SERVER_RANK}), got {req.world_size}",
                param="world_size",
            )
        device = torch.device(self.llm.device)
        if req.backend == "nccl" and device.type != "cuda":
            raise APIError(
                f"backend 'nccl' needs an engine on a CUDA device; this one runs on {device.type}: "
                "use 'gloo'",
                param="backend",
            )
        async with self._exclusive("init_communicator"):
            if self.is_open:
                raise APIError(
                    "a communicator is open already; POST /close_communicator first",
                    409,
                    code="communicator_open",
                )
            try:  # the rendezvous waits for the trainer: in a thread of the engine core
                await self.llm.call_utility(
                    "join_communicator", req.host, req.port, req.backend, req.timeout_s
                )
            except EngineUnavailable as e:
                raise APIError(str(e), 503, code="engine_unavailable") from None
            except (RuntimeError, ValueError, OSError) as e:
                raise APIError(
                    f"could not join the trainer's group at {req.host}:{req.port} "
                    f"({req.backend}): {e}",
                    code="communicator_failed",
                ) from None
            try:
                await self.llm.call_utility("warmup_communicator")  # closes it on failure
            except EngineUnavailable as e:
                raise APIError(str(e), 503, code="engine_unavailable") from None
            except RuntimeError as e:
                raise APIError(
                    f"init_communicator: warm-up failed: {e}", 500, code="communicator_failed"
                ) from None
            self.is_open = True
        return {"status": "ok", "backend": req.backend, "rank": SERVER_RANK, "world_size": 2}

    async def update(self, params: list[NamedParam]) -> dict:
        """Have the engine core receive the announced tensors by broadcast and load them."""
        if not params:
            raise APIError("announce at least one tensor", param="params")
        specs = [_spec(i, p) for i, p in enumerate(params)]
        async with self._exclusive("update_named_params"):
            if not self.is_open:
                raise APIError(
                    "no communicator: POST /init_communicator first",
                    409,
                    code="no_communicator",
                )
            try:
                num = await self.llm.call_utility("update_named_params", specs)
            except CommunicatorFailed as e:
                self.is_open = False
                raise APIError(
                    f"receiving the weights failed, so the communicator is closed; init it again: "
                    f"{e}",
                    500,
                    code="communicator_failed",
                ) from None
            except EngineUnavailable as e:
                raise APIError(str(e), 503, code="engine_unavailable") from None
            except NotImplementedError as e:
                raise APIError(str(e), 501, code="not_implemented") from None
            except (ValueError, RuntimeError) as e:  # the group is in step and stays usable
                raise APIError(f"update_named_params: {e}", 400) from None
        return {"status": "ok", "num_tensors": num, "weights_version": self.llm.weights_version}

    async def close(self) -> dict:
        async with self._exclusive("close_communicator"):
            self.is_open = False
            try:  # in the engine loop: after any receive queued before it
                closed = await self.llm.call_utility("close_communicator")
            except EngineUnavailable:
                closed = False
        return {"status": "ok", "closed": closed}

    def _exclusive(self, what: str) -> asyncio.Lock:
        if self._busy.locked():
            raise APIError(
                f"{what}: another communicator operation is in progress", 409, code="busy"
            )
        return self._busy


def _spec(i: int, p: NamedParam) -> TensorSpec:
    dtype = getattr(torch, p.dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise APIError(f"params.{i}.dtype: {p.dtype!r} is not a torch dtype", param="dtype")
    if any(d < 0 for d in p.shape):
        raise APIError(f"params.{i}.shape: negative size in {p.shape}", param="shape")
    return TensorSpec(p.name, dtype, tuple(p.shape))
