"""`tandem bench throughput`'s tandem run on a CPU: every token counted, and the timed run pays
for its own prefill (its warm-up ran the same prompts, whose cached prefixes must not carry over)."""

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
