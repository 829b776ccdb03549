"""profile_decode: per-step figures from profiler events, and a CPU run end to end."""

import json

import pytest
import torch
from model_fixtures import make_tiny_model

from tandem import LLM, SamplingParams
from tandem.bench.profile_step import STEP, Event, category, profile_decode, summarize


def test_summarize_hand_computed():
    events = [
        Event(STEP, "cpu", 0, 1000), Event(STEP, "cpu", 1000, 1400),
        Event("cudaStreamSynchronize", "cpu", 700, 250),
        Event("cudaStreamSynchronize", "cpu", 2000, 150),
        Event("cudaGraphLaunch", "cpu", 10, 20),
        Event("_decode_kernel", "kernel", 100, 300), Event("_decode_kernel", "kernel", 1100, 300),
        Event("nvjet_hsh_128x256_gemm", "kernel", 400, 500),
        Event("nvjet_hsh_128x256_gemm", "kernel", 1400, 500),
        Event("_sample_chunk_kernel", "kernel", 950, 200),
        Event("Memcpy DtoH (Device -> Pinned)", "kernel", 1990, 200),
    ]
    r = summarize(events, num_steps=2)
    assert r["step_ms"] == pytest.approx(1.2)  # (1000 + 1400) us / 2 steps
    assert r["host_wait_ms"] == pytest.approx(0.2)
    assert r["host_busy_ms"] == pytest.approx(1.0)
    assert r["gpu_busy_ms"] == pytest.approx(1.0)  # 2000 us of kernels over 2 steps
    assert r["kernels_per_step"] == 3
    top = r["top_kernels"][0]
    assert top["name"] == "nvjet_hsh_128x256_gemm" and top["share"] == pytest.approx(0.5)
    assert top["calls_per_step"] == 1
    assert r["categories"]["attention"]["share"] == pytest.approx(0.3)
    assert r["categories"]["sampling"]["ms_per_step"] == pytest.approx(0.1)
    assert r["categories"]["copy/fill"]["ms_per_step"] == pytest.approx(0.1)


def test_categories():
    assert category("_rotary_kernel") == "norm/act/rope"
    assert category("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert category("_decode_merge_kernel") == "attention"
    assert category("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "all-reduce"
    assert category("void at::native::vectorized_elementwise_kernel<4>") == "other"


def test_profile_decode_end_to_end(tmp_path, capsys):
    """On a CPU only host ops are reported; on a GPU, kernels."""
    on_gpu = torch.cuda.is_available()
    model = make_tiny_model("llama").to("cuda" if on_gpu else "cpu")
    llm = LLM(model, block_size=4, max_num_seqs=8, gpu_memory_utilization=0.1)
    trace = tmp_path / "trace.json"
    r = profile_decode(llm, num_steps=3, trace_path=str(trace), prompt_len=10)
    # at least the steps asked for: a decode window (num_scheduler_steps) runs several a call
    window = llm.llm_engine.config.num_scheduler_steps
    assert r["batch"] == 8 and 3 <= r["num_steps"] < 3 + window
    assert r["wall_ms"] > 0 and r["step_ms"] > 0
    if not on_gpu:
        assert "ceiling_ms" not in r  # no roofline claimed for a CPU
    if on_gpu:
        assert r["gpu_busy_ms"] > 0 and r["top_kernels"]
        assert sum(c["share"] for c in r["categories"].values()) == pytest.approx(1.0)
    else:
        assert r["top_cpu_ops"] and "gpu_busy_ms" not in r
    assert json.loads(trace.read_text())  # a chrome trace
    assert "decode profile" in capsys.readouterr().out
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.num_free_blocks() == llm.llm_engine.num_blocks


def test_profile_decode_with_spawned_tensor_parallel_ranks():
    """Spawned ranks only follow mirrored calls: the profile drives `generate`, so rank 1 runs the
    same steps, and rank 0's profile shows the all-reduces; the engine stays usable after."""
    from tandem import SamplingParams

    model = make_tiny_model("qwen2", num_attention_heads=4, num_key_value_heads=2)
    llm = LLM(model, tensor_parallel_size=2, device="cpu", max_num_seqs=4)
    try:
        r = profile_decode(llm, num_steps=3, batch=4, prompt_len=8, verbose=False)
        assert r["num_steps"] == 3 and r["wall_ms"] > 0
        assert any("allreduce" in op["name"] for op in r["top_cpu_ops"])
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
        assert llm.llm_engine.num_free_blocks() == llm.llm_engine.num_blocks
    finally:
        llm.tp_workers.shutdown()


def test_profile_prefill_end_to_end(capsys):
    """Prompt-only steps of a full token budget: the engine is left idle with every block free."""
    from tandem.bench.profile_step import profile_prefill

    on_gpu = torch.cuda.is_available()
    model = make_tiny_model("llama").to("cuda" if on_gpu else "cpu")
    llm = LLM(model, block_size=4, max_num_seqs=8, max_num_batched_tokens=48, gpu_memory_utilization=0.1)
    engine = llm.llm_engine
    free = engine.block_manager.num_free_blocks
    r = profile_prefill(llm, num_steps=2, prompt_len=10)
    assert r["kind"] == "prefill" and r["batch"] == 4 and r["tokens_per_step"] == 40  # 48 // 10 prompts
    assert r["num_steps"] == 2 and r["wall_ms"] > 0 and r["step_ms"] > 0
    assert not engine.has_unfinished_requests() and engine.block_manager.num_free_blocks == free
    if on_gpu:
        assert r["gpu_busy_ms"] > 0
    else:
        assert r["top_cpu_ops"] and "floor_ms" not in r
    assert "prefill profile: 4 prompts of 10 tokens a step (40 tokens), 2 steps" in capsys.readouterr().out
    rid = engine.add_request(None, [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle engine"):
        profile_prefill(llm)
    engine.abort_request(rid)


def test_profile_decode_refuses_a_max_model_len_without_room():
    """A batch that would finish before the steps asked for is refused up front, never looped on."""
    llm = LLM(make_tiny_model("llama"), block_size=4, max_num_seqs=4, max_model_len=40)
    with pytest.raises(ValueError, match="max_model_len 40 leaves no room"):
        profile_decode(llm, num_steps=20)
    assert not llm.llm_engine.has_unfinished_requests()


def test_profile_prefill_steps_compute_every_prompt_token():
    """Each step's prompts are its own: with the prefix cache on, none of them is a cache hit, so
    a step computes its full token budget (the same prompts again would cost one block's worth)."""
    from tandem.bench.profile_step import profile_prefill

    llm = LLM(make_tiny_model("llama"), block_size=4, max_num_seqs=8, max_num_batched_tokens=48,
              enable_prefix_caching=True)
    engine = llm.llm_engine
    computed = []
    step = engine.step

    def counting_step():
        before = engine.step_stats["prefill_or_mixed"][0]
        out = step()
        if engine.step_stats["prefill_or_mixed"][0] > before:
            computed.append(engine.block_manager.num_prefix_hits)
        return out

    engine.step = counting_step
    r = profile_prefill(llm, num_steps=3, prompt_len=12, verbose=False)
    assert r["tokens_per_step"] == 48 and len(computed) == 7  # warm-up, 3 timed, 3 profiled
    assert computed == [computed[0]] * 7  # no prefix-cache hit in any of them


def test_profile_prefill_after_profile_decode_on_one_engine():
    """`bench throughput --profile` runs the decode profile, then the prompt profile, on one engine
    with the prefix cache on: the prompt steps must not meet the decode profile's prompts there
    (they once did: both drew prompts from seed 0)."""
    from tandem.bench.profile_step import profile_prefill

    llm = LLM(make_tiny_model("llama"), block_size=4, max_num_seqs=4, max_num_batched_tokens=48,
              max_model_len=96, enable_prefix_caching=True)
    engine = llm.llm_engine
    profile_decode(llm, num_steps=2, prompt_len=12, verbose=False)
    hits = engine.block_manager.num_prefix_hits
    r = profile_prefill(llm, num_steps=2, prompt_len=12, verbose=False)
    assert r["tokens_per_step"] == 48 and engine.block_manager.num_prefix_hits == hits
