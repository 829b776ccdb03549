"""ServerClient: the trainer's side of the server mode (a `tandem serve --enable-admin-api` process).

Weights go over a collective group (NCCL between GPUs, gloo on CPUs), never through HTTP bodies
or disk: the trainer hosts the group's TCPStore on a free port and is rank 0, the server joins as
rank 1. Rollouts come back from /v1/completions with token ids and sampled logprobs.

Each collective step pairs with one HTTP call: the server counts the steps it enters in the
group's store, and the trainer joins a step only once the server has, so a refused call is
raised at once and never leaves the trainer waiting in a collective.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, Self

import torch

from tandem.weights.communicator import (
    TRAINER_RANK,
    Communicator,
    open_store,
    steps_entered,
    wait_ready,
)


class ServerError(RuntimeError):
    """The server answered an error: its HTTP status, OpenAI error code and message."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(f"{status} {code or ''}: {message}".replace(" :", ":"))
        self.status, self.code, self.message = status, code, message


@dataclass
class Completion:
    prompt_index: int  # which prompt of the request it continues
    token_ids: list[int]
    logprobs: list[float] | None  # the server's logprob of each sampled token
    text: str
    finish_reason: str | None


class ServerClient:
    """HTTP + collective client of one `tandem serve` process."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.comm: Communicator | None = None

    # -- HTTP --------------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None, timeout: float | None = None):
        """The parsed JSON answer of one call; raises ServerError on an error status."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data, headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            raise _server_error(e.code, e.read()) from None
        return json.loads(raw) if raw else None

    def health(self) -> bool:
        try:
            self.request("GET", "/health", timeout=10)
            return True
        except (ServerError, OSError):
            return False

    # -- the collective group ----------------------------------------------------------------------
    def init_communicator(
        self,
        backend: Literal["nccl", "gloo"] = "nccl",
        host: str | None = None,
        device: torch.device | str | None = None,
        timeout_s: float = 300.0,
    ) -> dict:
        """Open a TCPStore on a free port of `host` (default: this machine's address towards the
        server) and form a two-party group with the server; NCCL runs on `device` (default: the
        current CUDA device)."""
        if self.comm is not None:
            raise RuntimeError("a communicator is open already; call close_communicator() first")
        host = host or self._own_address()
        if backend == "nccl":
            device = torch.device(device or f"cuda:{torch.cuda.current_device()}")
        store = open_store(host, 0, True, timeout_s)  # a free port, named in the call
        joined: list[Communicator] = []

        def join() -> None:
            comm = Communicator(store, TRAINER_RANK, 2, backend, timeout_s, device)
            comm.warmup()
            joined.append(comm)

        body = {
            "host": host,
            "port": store.port,
            "world_size": 2,
            "backend": backend,
            "timeout_s": timeout_s,
        }
        result = self._paired("/init_communicator", body, store, 1, timeout_s, join)
        self.comm = joined[0]
        return result

    def push_weights(
        self,
        model: torch.nn.Module,
        batch_size: int = 32,
        dtype: torch.dtype | None = None,
    ) -> dict:
        """Send every tensor of `model.state_dict()`: one announce per `batch_size` tensors, each
        tensor then broadcast (cast to `dtype` first if given). Returns the last answer (its
        `weights_version`) with `num_tensors` summed over the batches.

        After the server slept at level 2, send everything in one batch (`batch_size=0`): the
        engine accepts new weights then only when they cover every parameter.
        """
        items = list(model.state_dict().items())
        step = batch_size if batch_size > 0 else len(items)
        answer, total = {}, 0
        for start in range(0, len(items), step):
            answer = self.update_named_params(items[start : start + step], dtype)
            total += answer["num_tensors"]
        return {**answer, "num_tensors": total}

    def update_named_params(
        self, named: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
    ) -> dict:
        """Announce (name, dtype, shape) of each tensor, then broadcast them in that order."""
        comm = self._require_comm()
        specs = [
            {
                "name": n,
                "dtype": str(dtype or t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
            }
            for n, t in named
        ]

        def send() -> None:
            with torch.no_grad(), comm.on_device():
                for t in _prepared(named, comm.device, dtype):
                    comm.broadcast(t)
                if comm.device.type == "cuda":  # the sent copies may be freed after this
                    torch.cuda.current_stream().synchronize()

        step = steps_entered(comm.store) + 1
        return self._paired("/update_named_params", specs, comm.store, step, self.timeout_s, send)

    def close_communicator(self) -> None:
        """Close the group on both sides (the server's half even when ours is gone already)."""
        comm, self.comm = self.comm, None
        errors: list[BaseException] = []

        def close_remote() -> None:
            try:
                self.request("POST", "/close_communicator", timeout=60)
            except BaseException as e:  # noqa: BLE001 - re-raised below, in the caller's thread
                errors.append(e)

        # Both halves at once: NCCL's teardown may wait for the peer's, so closing one side after
        # the other's reply would deadlock.
        remote = threading.Thread(target=close_remote, name="close-communicator", daemon=True)
        remote.start()
        try:
            if comm is not None:
                comm.close()
        finally:
            remote.join(timeout=70)
        if errors:
            raise errors[0]

    def _paired(
        self,
        path: str,
        body: Any,
        store,
        step: int,
        timeout_s: float,
        collective: Callable[[], None],
    ) -> dict:
        """POST `body` to `path` and run `collective` once the server has entered collective step
        `step`; a refusal before that is raised as the server's error, and leaves nothing behind.
        """
        http = _in_thread(lambda: self.request("POST", path, body))
        try:
            ready = wait_ready(store, step, http.done, timeout_s)
        except TimeoutError:
            self._drop_comm()  # the server may still enter the step later, and wait there for us
            raise
        if not ready:
            if http.exception() is not None:
                raise http.exception()
            raise RuntimeError(f"{path} answered {http.result()} without joining the collective")
        try:
            collective()
        except Exception as e:
            self._drop_comm()  # the group is out of step; the server closes its side too
            try:
                http.result(timeout=30)  # the server's side of the story, if it has one
            except Exception as server_side:  # noqa: BLE001 (reported with ours)
                raise RuntimeError(f"{path}: the collective failed ({e}); {server_side}") from e
            raise
        return http.result()

    def _drop_comm(self) -> None:
        comm, self.comm = self.comm, None
        if comm is not None:
            comm.close()

    def _require_comm(self) -> Communicator:
        if self.comm is None:
            raise RuntimeError("no communicator: call init_communicator() first")
        return self.comm

    def _own_address(self) -> str:
        """The local address this machine uses to reach the server (where the server can reach
        our TCPStore)."""
        url = urllib.parse.urlsplit(self.base_url)
        port = url.port or (443 if url.scheme == "https" else 80)
        with socket.create_connection((url.hostname, port), timeout=10) as s:
            return s.getsockname()[0]

    # -- generation and the engine's memory ---------------------------------------------------------
    def generate(
        self, prompt_token_ids: list[list[int]], sampling: dict | None = None
    ) -> list[Completion]:
        """`n` completions per prompt (prompt-major order) with token ids and sampled logprobs.

        `sampling` holds /v1/completions fields: temperature, top_p, max_tokens, n, seed, ...
        """
        sampling = dict(sampling or {})
        body = {
            "prompt": [list(p) for p in prompt_token_ids],
            "logprobs": 0,
            "return_token_ids": True,
            **sampling,
        }
        answer = self.request("POST", "/v1/completions", body)
        n = int(sampling.get("n") or 1)
        out = []
        for choice in sorted(answer["choices"], key=lambda c: c["index"]):
            lp = choice.get("logprobs")
            out.append(
                Completion(
                    prompt_index=choice["index"] // n,
                    token_ids=choice["token_ids"],
                    logprobs=lp["token_logprobs"] if lp else None,
                    text=choice["text"],
                    finish_reason=choice["finish_reason"],
                )
            )
        return out

    def sleep(self, level: int = 1) -> dict:
        return self.request("POST", f"/sleep?level={level}")

    def wake_up(self, tags: list[str] | None = None) -> dict:
        query = "&".join(f"tags={t}" for t in tags or [])
        return self.request("POST", "/wake_up" + (f"?{query}" if query else ""))

    def reset_prefix_cache(self) -> dict:
        return self.request("POST", "/reset_prefix_cache")

    def close(self) -> None:
        """Close the communicator if one is open."""
        if self.comm is not None:
            self.close_communicator()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _prepared(
    named: list[tuple[str, torch.Tensor]], device: torch.device, dtype: torch.dtype | None
) -> Iterator[torch.Tensor]:
    """Each tensor whole (DTensor shards gathered), on the group's device, contiguous; one at a
    time so that at most one extra copy exists."""
    for _, t in named:
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        yield t.detach().to(device=device, dtype=dtype or t.dtype).contiguous()


def _in_thread(fn: Callable[[], Any]) -> cf.Future:
    """`fn()` on a daemon thread (an HTTP call that waits on the collective)."""
    fut: cf.Future = cf.Future()

    def run() -> None:
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001 (handed to the waiter)
            fut.set_exception(e)

    threading.Thread(target=run, daemon=True, name="tandem-server-client").start()
    return fut


def _server_error(status: int, raw: bytes) -> ServerError:
    try:
        err = json.loads(raw)["error"]
        return ServerError(status, err.get("message", ""), err.get("code"))
    except (ValueError, KeyError, TypeError):
        return ServerError(status, raw.decode(errors="replace")[:500])
