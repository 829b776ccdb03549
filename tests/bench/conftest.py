"""Fixtures for bench tests: a stub OpenAI server on 127.0.0.1 and a quick ServeConfig for it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tandem.bench.client import TargetConfig
from tandem.bench.datasets import DatasetConfig
from tandem.bench.load import LoadConfig
from tandem.bench.serve import ServeConfig

from .stub_server import StubConfig, StubServer


@pytest.fixture
def stub():
    """`with stub(tpot_ms=5, ...) as server:` starts a StubServer with that config."""

    @contextmanager
    def make(**kw) -> Iterator[StubServer]:
        with StubServer(StubConfig(**kw)) as server:
            yield server

    return make


def quick_config(
    base_url: str,
    num_prompts: int = 20,
    output_len: int = 8,
    input_len: int = 16,
    load: LoadConfig | None = None,
    **kw,
) -> ServeConfig:
    """A small serve run against `base_url` (random-word prompts, no GPU monitor needed)."""
    endpoint = kw.pop("endpoint", TargetConfig.endpoint)
    return ServeConfig(
        target=TargetConfig(base_url=base_url, endpoint=endpoint),
        dataset=DatasetConfig(num_prompts=num_prompts, input_len=input_len, output_len=output_len),
        load=load or LoadConfig(),
        **kw,
    )
