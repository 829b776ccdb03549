"""AsyncLLM without HTTP: a failing step fails only its requests, shutdown leaves nobody waiting,
an idle engine thread does not step."""

from __future__ import annotations

import asyncio
import time

import pytest

from tandem import SamplingParams
from tandem.config import EngineConfig
from tandem.serve.async_engine import AsyncLLM, EngineError, EngineUnavailable

GREEDY = SamplingParams(temperature=0, max_tokens=6)


def _llm(model_dir: str) -> AsyncLLM:
    return AsyncLLM.from_config(EngineConfig(model=model_dir, device="cpu", max_num_seqs=8))


async def _tokens(llm: AsyncLLM, rid: str, params: SamplingParams = GREEDY) -> list[int]:
    ids: list[int] = []
    async for out in llm.generate(rid, [5, 6, 7, 8], params):
        ids += out.outputs[0].token_ids
    return ids


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    llm = _llm(tiny_llama_dir)
    yield llm
    llm.shutdown()


def test_a_failing_step_fails_its_requests_and_the_engine_lives_on(llm, monkeypatch):
    engine = llm.engine
    want = asyncio.run(_tokens(llm, "a"))
    real_step, calls = engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    with pytest.raises(EngineError, match="boom"):
        asyncio.run(_tokens(llm, "b"))
    assert asyncio.run(_tokens(llm, "c")) == want
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_idle_engine_thread_does_not_step(llm, monkeypatch):
    calls = []
    real_step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: calls.append(1) or real_step())
    asyncio.run(_tokens(llm, "d"))
    n = len(calls)
    time.sleep(0.2)
    assert len(calls) == n <= 7


def test_shutdown_leaves_nobody_waiting(tiny_llama_dir):
    llm = _llm(tiny_llama_dir)

    async def main() -> None:
        long = SamplingParams(max_tokens=400, ignore_eos=True)
        task = asyncio.ensure_future(_tokens(llm, "long", long))
        while not llm.engine.has_unfinished_requests():
            await asyncio.sleep(0.001)
        await asyncio.to_thread(llm.shutdown)
        with pytest.raises(EngineUnavailable):
            await task
        with pytest.raises(EngineUnavailable):
            llm.submit([("late", [5, 6], GREEDY)])
        with pytest.raises(EngineUnavailable):
            await llm.call(lambda engine: None)

    asyncio.run(main())
    assert not llm.is_alive and not llm.engine.has_unfinished_requests()
