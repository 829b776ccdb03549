"""EngineCore's loop: every step's outputs go out at once; a stats snapshot goes with every
iteration that took commands and with the one that leaves the engine idle, and in between at most
once per STATS_INTERVAL_S."""

from __future__ import annotations

from tandem import SamplingParams
from tandem.config import EngineConfig
from tandem.engine import core as core_mod
from tandem.engine.core import ADD, STOP, EngineCore
from tandem.engine.llm_engine import LLMEngine


def _run(engine: LLMEngine, cmds_per_call: list[list[tuple]]) -> list:
    """Run the loop over scripted commands (STOP once the script ends and the engine is idle)."""
    sent, script = [], iter(cmds_per_call)
    core = EngineCore(engine, sent.append)

    def get_commands(block: bool) -> list[tuple]:
        cmds = next(script, [])
        return cmds if cmds or not block else [(STOP,)]

    core.run_busy_loop(get_commands)
    return sent


def test_stats_go_with_commands_and_the_idle_step_only(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(core_mod, "STATS_INTERVAL_S", 3600.0)  # never due by time in this test
    engine = LLMEngine(EngineConfig(model=tiny_llama_dir, device="cpu", max_num_seqs=4))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    sent = _run(engine, [[(ADD, "a", [5, 6, 7], params, "delta")]])
    assert sent[0].stats is not None and sent[0].stats.num_added == 1  # took a command
    assert [m.stats for m in sent[1:-1]] == [None] * (len(sent) - 2)  # fresh enough
    last = sent[-1]
    assert last.outputs[-1].finished and last.stats is not None  # the engine is idle after it
    assert last.stats.num_unfinished == 0 and last.stats.generation_tokens == 5
    assert last.stats.num_free_blocks == last.stats.num_blocks
    tokens = [t for m in sent for o in m.outputs for t in o.outputs[0].token_ids]
    assert len(tokens) == 5  # every step's outputs went out, stats or not


def test_stats_follow_the_interval_while_stepping(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(core_mod, "STATS_INTERVAL_S", 0.0)
    engine = LLMEngine(EngineConfig(model=tiny_llama_dir, device="cpu", max_num_seqs=4))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    sent = _run(engine, [[(ADD, "a", [5, 6, 7], params, "delta")]])
    assert all(m.stats is not None for m in sent)
