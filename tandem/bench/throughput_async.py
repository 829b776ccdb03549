"""`tandem bench throughput --async-engine` (vLLM's flag): the timed run through AsyncLLM.

The engine runs in a process of its own, configured as `tandem serve` configures it; every request
streams delta outputs every `--stream-interval` tokens, and their text is made in this process
where a tokenizer is known. No HTTP: against the offline run in the same invocation this prices the
serving engine's path (the engine loop producing outputs, the pipe, the text), and against
`tandem bench serve` the HTTP server's.
"""

from __future__ import annotations

import asyncio
import time

import torch

from tandem.config import EngineConfig
from tandem.engine.async_llm import AsyncLLM
from tandem.sampling_params import SamplingParams


# Run in the engine process (module level: they travel by pickle).
def _start_timing(engine) -> dict:
    """Forget the warm-up's prefixes (the timed run sends the same prompts) and peak memory;
    the engine's figures to count from."""
    engine.reset_prefix_cache()
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
        torch.cuda.reset_peak_memory_stats(engine.device)
    return _engine_figures(engine)


def _engine_figures(engine) -> dict:
    return {
        "step_stats": {k: tuple(v) for k, v in engine.step_stats.items()},
        "device_wait_s": engine.device_wait_s,
        "prefix_hits": engine.block_manager.num_prefix_hits,
        "num_scheduler_steps": engine.config.num_scheduler_steps,
        "peak": torch.cuda.max_memory_allocated(engine.device) if engine.device.type == "cuda" else None,
        "kv_cache_blocks": engine.num_blocks,
        "preemptions": engine.scheduler.num_preemptions,
    }


def run_tandem_async(prompts: list[list[int]], out_lens: list[int], cfg) -> dict:
    """`run_tandem`'s figures for the same prompts, timed through AsyncLLM."""
    from tandem.bench.throughput import _figures, _load_format, add_step_figures, engine_kwargs

    config = EngineConfig.from_kwargs(
        model=cfg.model, load_format=_load_format(cfg), tokenizer=cfg.tokenizer,
        stream_interval=cfg.stream_interval, **engine_kwargs(cfg, prompts, out_lens))
    llm = AsyncLLM(config, engine_mode="process")
    print(f"tandem through AsyncLLM: the engine in its own process, {len(prompts)} requests streaming "
          f"deltas every {cfg.stream_interval} tokens" + ("" if llm.tokenizer is not None else " (no text: no tokenizer)"))
    try:
        span, produced, before, after = asyncio.run(_timed(llm, prompts, out_lens, cfg))
    finally:
        llm.shutdown()
    if produced != sum(out_lens):
        raise RuntimeError(f"ignore_eos requests produced {produced} tokens, not {sum(out_lens)}")
    fig = _figures("tandem", span, prompts, produced, after["peak"])
    steps = {k: (n - before["step_stats"][k][0], sec - before["step_stats"][k][1])
             for k, (n, sec) in after["step_stats"].items()}
    add_step_figures(fig, steps, after["device_wait_s"] - before["device_wait_s"],
                     after["prefix_hits"] - before["prefix_hits"], after["num_scheduler_steps"])
    fig.update(async_engine=True, stream_interval=cfg.stream_interval,
               kv_cache_blocks=after["kv_cache_blocks"], preemptions=after["preemptions"],
               num_scheduler_steps=after["num_scheduler_steps"])
    return fig


async def _timed(llm: AsyncLLM, prompts, out_lens, cfg):
    async def one(rid: str, prompt: list[int], params: SamplingParams) -> int:
        n = 0
        async for out in llm.generate(rid, {"prompt_token_ids": prompt}, params):
            n += len(out.outputs[0].token_ids)
        return n

    # a full first wave at 2 tokens compiles every kernel variant the timed run will launch
    warm = SamplingParams(temperature=cfg.temperature, max_tokens=2, ignore_eos=True)
    await asyncio.gather(*(one(f"warm-{i}", p, warm) for i, p in enumerate(prompts[: cfg.max_num_seqs])))
    before = await llm.call(_start_timing)
    t0 = time.perf_counter()
    produced = await asyncio.gather(*(
        one(f"timed-{i}", p, SamplingParams(temperature=cfg.temperature, max_tokens=o, ignore_eos=True))
        for i, (p, o) in enumerate(zip(prompts, out_lens))))
    t1 = time.perf_counter()
    after = await llm.call(_engine_figures)
    return (t0, t1), sum(produced), before, after
