"""Admin endpoints for the RL server mode: sleep, wake, weight updates (vLLM's paths), and the
collective group over which a trainer pushes weights (tandem.serve.weight_receiver).

Mounted only with `--enable-admin-api`, and then behind the API key. Each call runs in the engine
core (the engine's process, where the weights live) between two steps; an engine without the
method answers 501.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request

from tandem.engine.async_llm import AsyncLLM, EngineUnavailable
from tandem.engine.core import EngineBusy, InvalidWeights
from tandem.serve.errors import APIError
from tandem.serve.weight_receiver import InitCommunicatorRequest, NamedParam, WeightReceiver


def admin_router(llm: AsyncLLM) -> APIRouter:
    router = APIRouter(tags=["admin"])

    async def call(method: str, *args, idle: bool = False):
        try:
            return await llm.call_utility("call_engine", method, args, idle)
        except NotImplementedError as e:
            raise APIError(str(e), 501, code="not_implemented") from None
        except EngineBusy as e:
            raise APIError(str(e), 409, code="engine_busy") from None
        except EngineUnavailable as e:
            raise APIError(str(e), 503, code="engine_unavailable") from None
        except (ValueError, RuntimeError) as e:
            raise APIError(f"{method}: {e}", 400) from None

    def sleeping() -> bool:
        return llm.is_sleeping

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
        source = await _read_weights(request)
        try:  # the engine resets its prefix cache: cached KV came from the old weights
            num = await llm.call_utility("load_weights_from", *source)
        except InvalidWeights as e:
            raise APIError(str(e), code="invalid_body") from None
        except EngineUnavailable as e:
            raise APIError(str(e), 503, code="engine_unavailable") from None
        except (ValueError, RuntimeError, OSError) as e:
            raise APIError(f"update_weights: {e}", 400) from None
        return {"status": "ok", "num_tensors": num, "weights_version": llm.weights_version}

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


async def _read_weights(request: Request) -> tuple[str, str | bytes]:
    """("path", DIR) or ("safetensors", BYTES): parsed in the engine core, where weights live."""
    if request.headers.get("content-type", "").startswith("application/json"):
        try:
            path = (await request.json())["path"]
        except (ValueError, KeyError, TypeError):
            raise APIError(
                'the JSON body must be {"path": "<checkpoint dir>"}', param="path"
            ) from None
        if not isinstance(path, str):
            raise APIError("path must be a string", param="path")
        return "path", path
    return "safetensors", await request.body()
