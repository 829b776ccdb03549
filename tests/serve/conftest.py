"""Real servers shared by the whole session (each starts an engine process, seconds on a CPU):
the tiny Llama on CPU behind uvicorn on an ephemeral port, plain and with the admin API. Tests
leave them as they found them (idle, awake, the original weights)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tandem import LLM

from .helpers import ADMIN_KEY, Server, run_server


@pytest.fixture(scope="session")
def server(tiny_llama_dir) -> Iterator[Server]:
    with run_server(tiny_llama_dir) as s:
        yield s


@pytest.fixture(scope="session")
def admin(tiny_llama_dir) -> Iterator[Server]:
    """With --enable-admin-api behind ADMIN_KEY; sleep mode on; small blocks (prefix caching
    shows within a short prompt)."""
    app_kwargs = {"api_key": ADMIN_KEY, "enable_admin_api": True}
    with run_server(tiny_llama_dir, app_kwargs, enable_sleep_mode=True, block_size=4) as s:
        yield s


@pytest.fixture(scope="module")
def offline(tiny_llama_dir) -> LLM:
    """The offline API on the same weights: what the server's greedy answers must equal."""
    return LLM(tiny_llama_dir, device="cpu")
