"""One real server per test module: the tiny Llama on CPU behind uvicorn on an ephemeral port."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tandem import LLM

from .helpers import Server, run_server


@pytest.fixture(scope="module")
def server(tiny_llama_dir) -> Iterator[Server]:
    with run_server(tiny_llama_dir) as s:
        yield s


@pytest.fixture(scope="module")
def offline(tiny_llama_dir) -> LLM:
    """The offline API on the same weights: what the server's greedy answers must equal."""
    return LLM(tiny_llama_dir, device="cpu")
