"""Tensor parallel on a CPU (gloo, 2 ranks): TP=2 gives TP=1's tokens, in both start modes.

Explicit mode: two processes each initialise gloo and build `LLM(..., tensor_parallel_size=2)`, as
ranks under torchrun do. Spawned mode: `LLM(..., tensor_parallel_size=2)` alone spawns rank 1.
TP=1 references are computed here, in the test process.
"""

import json
import os

import pytest
import torch
import torch.distributed as dist
from model_fixtures import assert_no_leak, make_tiny_model, record_schedules
from spawn_ranks import spawn_ranks

from tandem import LLM, SamplingParams
from tandem.models.loader import iterate_checkpoint

PROMPTS = [[5, 17, 33, 8, 91, 4, 60], [12, 3], list(range(40, 79)), [200, 201, 202, 203, 204, 205]]
ENGINE = dict(block_size=4, max_num_batched_tokens=16, device="cpu")  # chunked prefill, many blocks
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, logprobs=2, seed=7)
CASES = {  # name -> (arch, overrides)
    "llama": ("llama", {}),  # 4 heads, 2 KV heads: KV heads split
    # one KV head for two ranks: replicated; o_proj bias: added once, after the all-reduce
    "llama-kv1-bias": ("llama", {"num_key_value_heads": 1, "attention_bias": True}),
    "qwen2": ("qwen2", {}),  # q/k/v bias
    # 321 = 161 + 160: the last vocabulary shard is padded, and shared with lm_head
    "qwen2-tied-odd-vocab": ("qwen2", {"tie_word_embeddings": True, "vocab_size": 321}),
    "qwen3": ("qwen3", {}),  # q/k norm
}
RELOAD_CASE, RELOAD_SEED = "qwen2", 1  # load_weights under TP: every weight replaced


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _logprobs(outs):
    completions = [o.outputs[0] for o in outs]
    return [[lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)] for c in completions]


def _run(llm) -> dict:
    greedy = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    sampled = llm.generate(PROMPTS, SAMPLED, use_tqdm=False)
    return {
        "greedy": _tokens(greedy), "sampled": _tokens(sampled), "sampled_lp": _logprobs(sampled)
    }


def _explicit_rank(rank: int, store: str, model_dirs: dict, out_dir: str) -> None:
    """One of two ranks started by the test, as torchrun would start them. Models come from
    directories: building HF models here would import transformers' modeling code (slow)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    with pytest.raises(ValueError, match="same seed"):  # ranks that would fall out of step
        LLM(model_dirs["llama"], tensor_parallel_size=2, seed=rank, **ENGINE)
    results = {}
    for name in CASES:
        llm = LLM(model_dirs[name], tensor_parallel_size=2, **ENGINE)
        assert llm.tp_workers is None  # a process group exists: this process is one rank
        results[name] = _run(llm)
        if name == RELOAD_CASE:
            llm.load_weights(iterate_checkpoint(model_dirs["reload"]))
            results["reloaded"] = _run(llm)
        assert_no_leak(llm)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _reference(arch, overrides, seed=0) -> dict:
    return _run(LLM(make_tiny_model(arch, seed=seed, **overrides), **ENGINE))


def _assert_same(got: dict, ref: dict, what: str) -> None:
    assert got["greedy"] == ref["greedy"], f"{what}: greedy tokens differ from TP=1"
    assert got["sampled"] == ref["sampled"], f"{what}: sampled tokens differ from TP=1"
    for g, r in zip(got["sampled_lp"], ref["sampled_lp"]):
        assert g == pytest.approx(r, abs=1e-4), f"{what}: sampled-token logprobs differ from TP=1"


def test_explicit_ranks_match_tp1(tmp_path):
    """Two processes, each its own rank with gloo initialised by the caller (the torchrun case)."""
    dirs = {}
    for name, (arch, overrides) in CASES.items():
        dirs[name] = str(tmp_path / name)
        make_tiny_model(arch, **overrides).save_pretrained(dirs[name])
    arch, overrides = CASES[RELOAD_CASE]
    dirs["reload"] = str(tmp_path / "reload")
    make_tiny_model(arch, seed=RELOAD_SEED, **overrides).save_pretrained(dirs["reload"])
    spawn_ranks(_explicit_rank, 2, str(tmp_path / "store"), dirs, str(tmp_path), log_dir=tmp_path / "logs")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1], "the two ranks disagree"
    for name, (arch, overrides) in CASES.items():
        _assert_same(ranks[0][name], _reference(arch, overrides), name)
    arch, overrides = CASES[RELOAD_CASE]
    reloaded = _reference(arch, overrides, seed=RELOAD_SEED)
    assert reloaded["greedy"] != ranks[0][RELOAD_CASE]["greedy"]  # the update changed the outputs
    _assert_same(ranks[0]["reloaded"], reloaded, "after load_weights")


def test_spawned_workers_in_memory_model():
    """LLM(in-memory HF model, tensor_parallel_size=2): the model is saved to a temp dir that
    both ranks load; rank 1 is spawned and follows the driver's calls."""
    model = make_tiny_model("qwen2", num_key_value_heads=4)
    ref = _reference("qwen2", {"num_key_value_heads": 4})
    llm = LLM(model, tensor_parallel_size=2, **ENGINE)
    try:
        assert llm.tp_workers.num_workers == 1
        with pytest.raises(RuntimeError, match="shutdown"):  # its world is this process's one
            LLM(model, tensor_parallel_size=2, **ENGINE)
        assert llm.llm_engine.worker.model_runner.attn_layers[0].num_kv_heads == 2  # 4 KV heads, 2 ranks
        _assert_same(_run(llm), ref, "spawned")
        with pytest.raises(NotImplementedError, match="torchrun"):
            llm.load_weights(model.state_dict().items())
        with pytest.raises(ValueError, match="prompt"):  # both ranks refuse it and stay in step
            llm.generate([[]], GREEDY, use_tqdm=False)
        assert _tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)) == ref["greedy"][:1]
        assert_no_leak(llm)
    finally:
        llm.tp_workers.shutdown()
    assert not dist.is_initialized()  # the driver's process group is gone with its workers
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def test_spawned_workers_model_dir_text_sleep_wake(tiny_llama_dir):
    """A model directory with a tokenizer: text prompts, stop strings, chat, sleep/wake and a
    prefix-cache reset are mirrored to rank 1, which stays in step."""
    kwargs = dict(ENGINE, enable_sleep_mode=True)
    params = SamplingParams(temperature=0, max_tokens=16, stop=["e"],
                            include_stop_str_in_output=True)
    prompts = ["The capital of France is", "Hello, my name is", "What is 2 + 3?"]
    ref_llm = LLM(tiny_llama_dir, **kwargs)
    ref = [o.outputs[0].text for o in ref_llm.generate(prompts, params, use_tqdm=False)]
    chat = [{"role": "user", "content": "What is 10 - 4?"}]
    ref_chat = ref_llm.chat(chat, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(tiny_llama_dir, tensor_parallel_size=2, **kwargs)
    try:
        assert [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)] == ref
        llm.sleep(1)
        llm.wake_up()
        llm.reset_prefix_cache()
        assert llm.chat(chat, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == ref_chat
        assert [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)] == ref
        assert_no_leak(llm)
    finally:
        llm.tp_workers.shutdown()


def test_spawned_workers_follow_decode_windows():
    """Every rank schedules alike, so a decode window (num_scheduler_steps) runs on both ranks in
    step; the tokens are tensor parallel's single steps' (and TP 1's)."""
    model = make_tiny_model("qwen2", num_key_value_heads=4)
    seeded = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=3, n=2, logprobs=0)
    ref = LLM(model, tensor_parallel_size=1, **ENGINE)
    want = [_tokens(ref.generate(PROMPTS, p, use_tqdm=False)) for p in (GREEDY, seeded)]
    llm = LLM(model, tensor_parallel_size=2, num_scheduler_steps=4, **ENGINE)
    try:
        scheduled = record_schedules(llm)
        got = [_tokens(llm.generate(PROMPTS, p, use_tqdm=False)) for p in (GREEDY, seeded)]
        assert max(s.num_steps for s in scheduled) == 4
        assert got == want
        assert_no_leak(llm)
    finally:
        llm.tp_workers.shutdown()
