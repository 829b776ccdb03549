"""AsyncLLM without HTTP, with the engine core in a thread and in a process: a failing step fails
only its requests, an idle core does not step, shutdown leaves nobody waiting."""

from __future__ import annotations

import asyncio
import time

import pytest

from tandem import SamplingParams
from tandem.config import EngineConfig
from tandem.engine.async_llm import AsyncLLM, EngineError, EngineUnavailable

GREEDY = SamplingParams(temperature=0, max_tokens=6)
MODES = ["process", "thread"]


def _llm(model_dir: str, mode: str) -> AsyncLLM:
    return AsyncLLM(EngineConfig(model=model_dir, device="cpu", max_num_seqs=8), engine_mode=mode)


async def _tokens(llm: AsyncLLM, rid: str, params: SamplingParams = GREEDY) -> list[int]:
    ids: list[int] = []
    async for out in llm.generate(rid, [5, 6, 7, 8], params):
        ids += out.outputs[0].token_ids
    return ids


# Run inside the engine core (module-level: in process mode they travel by pickle).
def _fail_step(engine, which: int) -> None:
    """The engine's `which`-th next step raises; the ones after it run normally."""
    real, calls = engine.step, []

    def step():
        calls.append(1)
        if len(calls) == which:
            del engine.step  # the class's step again
            raise RuntimeError("boom")
        return real()

    engine.step = step


def _count_steps(engine) -> None:
    real = engine.step
    engine.steps_seen = 0

    def step():
        engine.steps_seen += 1
        return real()

    engine.step = step


def _steps_seen(engine) -> int:
    return engine.steps_seen


def _free_blocks(engine) -> tuple[int, int]:
    return engine.block_manager.num_free_blocks, engine.block_manager.num_blocks


@pytest.fixture(scope="module", params=MODES)
def llm(request, tiny_llama_dir):
    llm = _llm(tiny_llama_dir, request.param)
    yield llm
    llm.shutdown()


def test_a_failing_step_fails_its_requests_and_the_engine_lives_on(llm):
    want = asyncio.run(_tokens(llm, "a"))
    asyncio.run(llm.call(_fail_step, 2))
    with pytest.raises(EngineError, match="boom"):
        asyncio.run(_tokens(llm, "b"))
    assert asyncio.run(_tokens(llm, "c")) == want
    free, total = asyncio.run(llm.call(_free_blocks))
    assert free == total
    assert llm.stats.num_free_blocks == llm.stats.num_blocks == total  # shipped with the step


def test_every_streamed_output_carries_its_prompt(llm):
    """The prompt crosses the process boundary in a request's first output only; the client puts
    it back, so each delta output (and the final one) reads the same as in thread mode."""
    prompt = {"prompt": "five six", "prompt_token_ids": [5, 6, 7, 8]}
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    async def outputs():
        return [out async for out in llm.generate("prompted", prompt, params)]

    outs = asyncio.run(outputs())
    # deltas that queue up while this consumer is busy are folded into one (RequestStream): up to
    # five outputs, the five tokens in all
    assert 1 <= len(outs) <= 5 and outs[-1].finished
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 5
    assert [(o.prompt, o.prompt_token_ids) for o in outs] == [("five six", [5, 6, 7, 8])] * len(outs)
    if llm.engine_mode == "process":
        assert llm.engine_core._prompts == {}  # nothing kept once the request finished

        async def abandon():  # a request left after its first output is aborted: forgotten too
            async for _ in llm.generate("abandoned", prompt, SamplingParams(max_tokens=50)):
                break

        asyncio.run(abandon())
        assert "abandoned" not in llm.engine_core._prompts


def test_idle_engine_core_does_not_step(llm):
    asyncio.run(llm.call(_count_steps))
    asyncio.run(_tokens(llm, "d"))
    n = asyncio.run(llm.call(_steps_seen))
    time.sleep(0.2)
    assert asyncio.run(llm.call(_steps_seen)) == n <= 7
    asyncio.run(llm.call(_undo_patch))


def _undo_patch(engine) -> None:
    del engine.step


def test_an_unpicklable_call_fails_in_the_caller(llm):
    if llm.engine_mode == "thread":
        assert asyncio.run(llm.call(lambda engine: 7)) == 7
    else:  # a lambda cannot cross processes: the caller hears it, the core never does
        with pytest.raises(Exception, match="pickle|lambda"):
            asyncio.run(llm.call(lambda engine: 7))
    assert asyncio.run(_tokens(llm, "e"))


@pytest.mark.parametrize("mode", MODES)
def test_shutdown_leaves_nobody_waiting(tiny_llama_dir, mode):
    llm = _llm(tiny_llama_dir, mode)

    async def main() -> None:
        long = SamplingParams(max_tokens=400, ignore_eos=True)
        task = asyncio.ensure_future(_tokens(llm, "long", long))
        while not llm.stats.num_unfinished:
            await asyncio.sleep(0.001)
        await asyncio.to_thread(llm.shutdown)
        with pytest.raises(EngineUnavailable, match="stopped"):
            await task
        with pytest.raises(EngineUnavailable):
            llm.submit([("late", [5, 6], GREEDY)])
        with pytest.raises(EngineUnavailable):
            await llm.call(_free_blocks)

    asyncio.run(main())
    assert not llm.is_alive
    if mode == "thread":
        assert not llm.engine_core.engine.has_unfinished_requests()
    else:
        assert llm.engine_core.proc.exitcode == 0  # it stopped when told, not killed


def _record_detokenize(engine) -> None:
    """The engine records the `detokenize` of every request it is given."""
    real, engine.seen_detokenize = engine.add_request, {}

    def add_request(rid, prompt, params, *args, **kwargs):
        engine.seen_detokenize[rid] = params.detokenize
        return real(rid, prompt, params, *args, **kwargs)

    engine.add_request = add_request


def _seen_detokenize(engine, rid: str) -> bool:
    return engine.seen_detokenize[rid]


def test_streamed_text_is_made_here_as_the_engine_would(llm):
    """Streamed deltas carry token ids from the engine and get their text in this process
    (DeltaText); requests whose text the engine needs or sends keep the engine's. Sampled text
    (random tokens: split multi-byte characters, special tokens), two samples a request, each
    sample's text the same both ways; a stop string still stops the text where it is."""

    async def texts(rid, params):
        got: dict[int, list] = {}
        async for out in llm.generate(rid, {"prompt_token_ids": [5, 6, 7, 8]}, params):
            for c in out.outputs:
                acc = got.setdefault(c.index, ["", []])
                acc[0] += c.text
                acc[1] += c.token_ids
        return got, await llm.call(_seen_detokenize, rid)

    asyncio.run(llm.call(_record_detokenize))
    for seed in range(3):
        base = SamplingParams(temperature=1.0, seed=seed, n=2, max_tokens=40, ignore_eos=True)
        here, engine_detokenized = asyncio.run(texts(f"here{seed}", base))
        assert engine_detokenized is False  # the engine sent token ids only
        there, engine_detokenized = asyncio.run(texts(f"there{seed}", base.clone(logprobs=0)))
        assert engine_detokenized is True  # logprobs' decoded tokens: the engine's text
        assert here == there and all(t for t, _ in here.values())
    skip = SamplingParams(temperature=1.0, seed=0, max_tokens=40, ignore_eos=True, skip_special_tokens=False)
    here, _ = asyncio.run(texts("skip_here", skip))
    there, _ = asyncio.run(texts("skip_there", skip.clone(logprobs=0)))
    assert here == there
    first = here[0][0][:3]
    stopped, engine_detokenized = asyncio.run(texts("stopped", base.clone(n=1, seed=0, stop=[first[1:]])))
    assert engine_detokenized is True and stopped[0][0] == first[:1]


def test_makes_text_rules():
    from tandem.engine.async_llm import _makes_text

    p = SamplingParams(max_tokens=4)
    assert _makes_text(p, "delta")
    assert not _makes_text(p, "final_only") and not _makes_text(p, "cumulative")
    for changed in ({"stop": ["x"]}, {"logprobs": 0}, {"prompt_logprobs": 1}, {"detokenize": False}):
        assert not _makes_text(p.clone(**changed), "delta"), changed
