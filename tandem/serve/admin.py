"""Admin endpoints for the RL server mode: sleep, wake, weight updates (vLLM's paths), and the
collective group over which a trainer pushes weights (tandem.serve.weight_receiver).

Mounted only with `--enable-admin-api`, and then behind the API key. Each call runs in the engine
thread between two steps; an engine without the method answers 501.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Query, Request

from tandem.serve.async_engine import AsyncLLM, EngineUnavailable
from tandem.serve.errors import APIError
from tandem.serve.weight_receiver import InitCommunicatorRequest, NamedParam, WeightReceiver


def admin_router(llm: AsyncLLM) -> APIRouter:
    router = APIRouter(tags=["admin"])

    async def call(method: str, *args, idle: bool = False):
        if not callable(getattr(llm.engine, method, None)):
            raise APIError(f"this engine has no {method}()", 501, code="not_implemented")

        def run(engine):
            if idle and engine.has_unfinished_requests():
                raise _Busy(
                    f"{engine.get_num_unfinished_requests()} requests are in flight; "
                    f"{method} waits for an idle engine"
                )
            return getattr(engine, method)(*args)

        try:
            return await llm.call(run)
        except _Busy as e:
            raise APIError(str(e), 409, code="engine_busy") from None
        except EngineUnavailable as e:
            raise APIError(str(e), 503, code="engine_unavailable") from None
        except (ValueError, RuntimeError) as e:
            raise APIError(f"{method}: {e}", 400) from None

    def sleeping() -> bool:
        return bool(getattr(llm.engine, "is_sleeping", False))

    @router.post("/sleep")
    async def sleep(level: Annotated[int, Query(ge=1, le=2)] = 1) -> dict:
        """Release the KV cache (and, at level 2, the weights); needs an idle engine."""
        report = await call("sleep", level, idle=True)
        return {"is_sleeping": sleeping(), **(report or {})}

    @router.post("/wake_up")
    async def wake_up(tags: Annotated[list[str] | None, Query()] = None) -> dict:
        """Restore `tags` ("weights", "kv_cache"; default both)."""
        report = await call("wake_up", tags)
        return {"is_sleeping": sleeping(), **(report or {})}

    @router.get("/is_sleeping")
    async def is_sleeping() -> dict:
        return {"is_sleeping": sleeping()}

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict:
        await call("reset_prefix_cache")
        return {"status": "ok"}

    @router.post("/update_weights")
    async def update_weights(request: Request) -> dict:
        """Body: safetensors bytes (application/octet-stream) of HF-named tensors, or JSON
        `{"path": DIR}` naming a checkpoint directory on the server's machine."""
        if not callable(getattr(llm.engine, "load_weights", None)):
            raise APIError("this engine has no load_weights()", 501, code="not_implemented")
        weights = await _read_weights(request)

        try:  # the engine resets its prefix cache: cached KV came from the old weights
            num = await llm.call(lambda engine: engine.load_weights(weights()))
        except (ValueError, RuntimeError, OSError) as e:
            raise APIError(f"update_weights: {e}", 400) from None
        return {
            "status": "ok",
            "num_tensors": num,
            "weights_version": getattr(llm.engine, "weights_version", None),
        }

    receiver = WeightReceiver(llm)

    @router.post("/init_communicator")
    async def init_communicator(req: InitCommunicatorRequest) -> dict:
        """Join the trainer's two-party group (its TCPStore at host:port) as rank 1."""
        return await receiver.init(req)

    @router.post("/update_named_param")
    async def update_named_param(param: NamedParam) -> dict:
        """Receive one tensor, broadcast by the trainer, and load it."""
        return await receiver.update([param])

    @router.post("/update_named_params")
    async def update_named_params(params: list[NamedParam]) -> dict:
        """Receive the listed tensors, broadcast by the trainer in this order, and load them."""
        return await receiver.update(params)

    @router.post("/close_communicator")
    async def close_communicator() -> dict:
        return await receiver.close()

    return router


class _Busy(Exception):
    pass


async def _read_weights(request: Request):
    """A callable giving the (name, tensor) pairs of the request's weights."""
    if request.headers.get("content-type", "").startswith("application/json"):
        from tandem.models.loader import iterate_checkpoint

        try:
            path = (await request.json())["path"]
        except (ValueError, KeyError, TypeError):
            raise APIError(
                'the JSON body must be {"path": "<checkpoint dir>"}', param="path"
            ) from None
        if not isinstance(path, str):
            raise APIError("path must be a string", param="path")
        return lambda: iterate_checkpoint(path)
    from safetensors import SafetensorError
    from safetensors.torch import load

    data = await request.body()
    try:
        tensors = await asyncio.to_thread(load, data)
    except SafetensorError as e:
        raise APIError(f"the body is not a safetensors file: {e}", code="invalid_body") from None
    return lambda: iter(tensors.items())
