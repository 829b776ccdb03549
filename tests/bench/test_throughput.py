"""`tandem bench throughput`'s tandem run on a CPU: every token counted, and the timed run pays
for its own prefill (its warm-up ran the same prompts, whose cached prefixes must not carry over)."""

import dataclasses

import pytest
import torch
from model_fixtures import make_tiny_model

from tandem.bench.throughput import ThroughputConfig, run_tandem


def test_timed_run_computes_every_prompt_token():
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (40,), generator=gen).tolist() for _ in range(6)]
    out_lens = [5] * 6
    cfg = ThroughputConfig(model=None, dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
                           progress=False)
    fig, _ = run_tandem(make_tiny_model("qwen2"), prompts, out_lens, cfg)
    assert fig["prefix_cache_hit_tokens"] == 0
    assert fig["step_stats"]["prefill_or_mixed"]["steps"] >= 240 // 64  # the prompts' 240 tokens


def test_timed_run_under_tensor_parallel_stays_in_step():
    """With TP=2 (a spawned rank, gloo) the cache reset reaches every rank: they keep scheduling
    alike, so the timed run finishes and hits no cached prefix."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (24,), generator=gen).tolist() for _ in range(4)]
    cfg = ThroughputConfig(model=None, dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
                           tensor_parallel_size=2, progress=False)
    fig, llm = run_tandem(make_tiny_model("qwen2", num_key_value_heads=4), prompts, [4] * 4, cfg)
    try:
        assert fig["prefix_cache_hit_tokens"] == 0
    finally:
        llm.tp_workers.shutdown()


def test_defaults_fit_the_device_and_architecture_names_get_random_weights(capsys):
    from tandem.bench.throughput import CPU_DEFAULTS, GPU_DEFAULTS, _load_format, apply_defaults

    cfg = ThroughputConfig(num_prompts=3)
    apply_defaults(cfg, {"num_prompts"}, cuda=False)
    assert (cfg.model, cfg.num_prompts, cfg.output_len) == (None, 3, CPU_DEFAULTS["output_len"])
    assert "no GPU: a small CPU workload" in capsys.readouterr().out
    cfg = ThroughputConfig()
    apply_defaults(cfg, set(), cuda=True)
    assert (cfg.model, cfg.num_prompts) == (GPU_DEFAULTS["model"], 256)
    assert _load_format(cfg) == "dummy"  # an architecture name: random weights
    assert _load_format(ThroughputConfig(model=None)) == "auto"  # the embedded model's own


def test_no_roofline_without_known_ceilings(capsys):
    from tandem.bench.roofline import device_ceilings
    from tandem.bench.throughput import _print_table

    if not torch.cuda.is_available():
        assert device_ceilings()[:2] == (None, None)
        assert device_ceilings(1e12, 1e14) == (1e12, 1e14, "the given ceilings")
    row = {"output_tokens_per_s": 10.0, "total_tokens_per_s": 20.0, "requests_per_s": 1.0,
           "peak_memory_gb": None, "roofline_fraction": None, "gpu": None}
    _print_table({"tandem": row})
    out = capsys.readouterr().out
    assert "roofline" not in out.splitlines()[0] and "no roofline" in out


def test_prefill_floor_counts_the_prompt_tokens_gemms_only():
    from transformers import Qwen2Config

    from tandem.bench.roofline import ModelShape, prefill_floor_seconds
    from tandem.models.presets import preset_config

    cfg = preset_config("qwen2.5-1.5b")
    shape = ModelShape.from_hf_config(cfg)
    assert cfg.tie_word_embeddings and shape.embedding_params == cfg.vocab_size * cfg.hidden_size
    body = shape.params - shape.embedding_params  # 28 layers of 1.5B: about 1.31e9
    assert 1.30e9 < body < 1.32e9
    assert prefill_floor_seconds(shape, 1000, flops=2e12) == body * 1000 * 2 / 2e12
    untied = ModelShape.from_hf_config(Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                   num_attention_heads=4, vocab_size=100,
                                                   tie_word_embeddings=False))
    assert untied.embedding_params == 2 * 100 * 64


def test_decode_ceiling_leaves_out_an_untied_input_embedding():
    """A decode step gathers one row of an untied input embedding a sequence: the table is
    neither read whole nor multiplied, so the ceiling counts the LM head and the layers only; a
    tied table is the LM head itself and counts once."""
    from transformers import Qwen2Config

    from tandem.bench.roofline import ModelShape, decode_step_seconds

    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=1000)
    tied = ModelShape.from_hf_config(Qwen2Config(tie_word_embeddings=True, **kw))
    untied = ModelShape.from_hf_config(Qwen2Config(tie_word_embeddings=False, **kw))
    assert untied.params == tied.params + 1000 * 64
    assert (tied.decode_params, untied.decode_params) == (tied.params, tied.params)
    assert untied.decode_weight_bytes == tied.weight_bytes
    for batch, context in ((1, 10), (4096, 0)):  # bandwidth-bound, then compute-bound
        assert decode_step_seconds(untied, batch, context, hbm=1e12, flops=1e12) == \
            decode_step_seconds(tied, batch, context, hbm=1e12, flops=1e12)
    assert decode_step_seconds(tied, 4096, 0, hbm=1e15, flops=1e12) == 2 * tied.params * 4096 / 1e12
    assert decode_step_seconds(tied, 1, 10, hbm=1e12, flops=1e15) == \
        (tied.weight_bytes + 10 * tied.kv_bytes_per_token) / 1e12


def test_phases_split_the_run_and_print_against_the_prefill_floor(capsys):
    from tandem.bench.throughput import _print_table, phases

    fig = {"elapsed_s": 1.0, "output_tokens_per_s": 100.0, "total_tokens_per_s": 150.0,
           "requests_per_s": 1.0, "peak_memory_gb": None, "roofline_fraction": 0.3, "gpu": None,
           "step_stats": {"decode": {"steps": 255, "seconds": 0.72, "ms_per_step": 2.8},
                          "prefill_or_mixed": {"steps": 5, "seconds": 0.16, "ms_per_step": 32.0}}}
    fig["phases"] = phases(fig, prefill_floor_s=0.112)
    assert fig["phases"]["decode"] == {"steps": 255, "seconds": 0.72, "share_of_run": 0.72}
    assert fig["phases"]["prefill_or_mixed"]["floor_fraction"] == 0.112 / 0.16
    assert "floor_fraction" not in phases(fig, None)["prefill_or_mixed"]
    _print_table({"tandem": fig}, "a test device")
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("tandem phases"))
    assert line == ("tandem phases: steps with prompt tokens 5 x, 0.160 s (16% of the run; their GEMMs' "
                    "compute floor 0.112 s, 70% of their time); decode-only steps 255 x, 0.720 s "
                    "(72% of the run)")


def test_run_reports_phases_against_given_ceilings(capsys):
    """The whole command on a CPU, ceilings given: the report's phases cover the timed run."""
    from tandem.bench.throughput import run

    cfg = ThroughputConfig(model=None, num_prompts=2, input_len=8, output_len=3, dtype="float32",
                           hbm_bytes_per_s=1e12, peak_flops=1e14, progress=False)
    report = run(cfg)
    ph = report["results"]["tandem"]["phases"]
    assert ph["prefill_or_mixed"]["steps"] >= 1 and ph["decode"]["steps"] >= 1
    assert 0 < ph["prefill_or_mixed"]["compute_floor_s"] < ph["prefill_or_mixed"]["seconds"]
    assert sum(p["share_of_run"] for p in ph.values()) <= 1.0
    assert "tandem phases: steps with prompt tokens" in capsys.readouterr().out


def test_profile_adds_a_decode_and_a_prompt_step_profile(capsys, tiny_llama_dir):
    """--profile: after the timed run, decode steps and prompt-only steps of the run's prompt
    length, each in the report and printed."""
    from tandem.bench.throughput import run

    # (max_model_len is the run's longest request: room for the profile's 57 decode tokens)
    cfg = ThroughputConfig(model=tiny_llama_dir, num_prompts=4, input_len=8, output_len=60, dtype="float32",
                           max_num_batched_tokens=32, profile=True, progress=False)
    fig = run(cfg)["results"]["tandem"]
    assert fig["profile"]["batch"] == 4 and fig["profile"]["num_steps"] >= 20
    assert fig["profile_prefill"]["kind"] == "prefill" and fig["profile_prefill"]["tokens_per_step"] == 32
    out = capsys.readouterr().out
    assert "decode profile: batch 4" in out and "prefill profile: 4 prompts of 8 tokens a step" in out


def test_async_engine_times_the_same_requests_through_the_serving_engine(capsys, tiny_llama_dir):
    """--async-engine: the engine in its own process, every request streamed in deltas with its
    text made here; the same figures as the offline run (every output token, the engine's steps)."""
    from tandem.bench.throughput import run

    cfg = ThroughputConfig(model=tiny_llama_dir, num_prompts=6, input_len=8, output_len=(3, 9),
                           dtype="float32", max_num_seqs=4, async_engine=True, stream_interval=2,
                           tokenizer=tiny_llama_dir, hbm_bytes_per_s=1e12, peak_flops=1e14, progress=False)
    report = run(cfg)
    fig = report["results"]["tandem"]
    out = capsys.readouterr().out
    assert "tandem steps: " in out and "tandem phases: " in out
    assert fig["async_engine"] and fig["stream_interval"] == 2
    assert fig["step_stats"]["decode"]["steps"] >= 1 and fig["step_stats"]["prefill_or_mixed"]["steps"] >= 1
    assert fig["prefix_cache_hit_tokens"] == 0  # the warm-up's prefixes were forgotten
    offline = run(dataclasses.replace(cfg, async_engine=False, stream_interval=1, tokenizer=None))
    assert fig["output_tokens"] == offline["results"]["tandem"]["output_tokens"]  # the same requests
    assert fig["input_tokens"] == offline["results"]["tandem"]["input_tokens"]


@pytest.mark.parametrize("changes, field", [({"async_engine": True, "profile": True}, "--profile"),
                                            ({"async_engine": True, "tensor_parallel_size": 2}, "--tensor-parallel-size"),
                                            ({"stream_interval": 4}, "--stream-interval"),
                                            ({"tokenizer": "tok"}, "--tokenizer")])
def test_async_engine_settings_are_checked_first(changes, field):
    from tandem.bench.throughput import check_async_engine

    with pytest.raises(ValueError, match=field):
        check_async_engine(ThroughputConfig(**changes))


def test_host_only_times_the_engines_host_work(capsys, tiny_llama_dir):
    """--host-only, offline and through AsyncLLM: every requested token comes back (the fixed
    one), the engine's steps are counted, no roofline is claimed; a peer or a profile is refused
    before any work."""
    from tandem.bench.throughput import run

    cfg = ThroughputConfig(model=tiny_llama_dir, num_prompts=6, input_len=8, output_len=(3, 9),
                           dtype="float32", max_num_seqs=4, host_only=True, hbm_bytes_per_s=1e12,
                           peak_flops=1e14, progress=False)
    real = run(dataclasses.replace(cfg, host_only=False))["results"]["tandem"]
    assert real["roofline_fraction"] is not None
    capsys.readouterr()
    for run_cfg in (cfg, dataclasses.replace(cfg, async_engine=True, stream_interval=2,
                                             tokenizer=tiny_llama_dir)):
        fig = run(run_cfg)["results"]["tandem"]
        assert fig["output_tokens"] == real["output_tokens"]  # the same requests, every token
        assert fig["step_stats"]["decode"]["steps"] >= 1
        assert fig["roofline_fraction"] is None
        assert "host only: no forward and no sampling" in capsys.readouterr().out
    for bad in ({"compare": ["hf"]}, {"profile": True}):
        with pytest.raises(ValueError, match="--host-only"):
            run(dataclasses.replace(cfg, **bad))
