"""Sleep / wake / in-place weight updates (invariants 2 and 3), on the CPU and on the GPU."""

import time

import pytest
import torch
from model_fixtures import assert_no_leak, make_tiny_model

from tandem import LLM, SamplingParams

PROMPTS = [[5, 17, 33, 8, 91], list(range(40, 70))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)


def run(llm):
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    ids = [o.outputs[0].token_ids for o in outs]
    lps = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return ids, lps


def perturbed(model, seed=1):
    gen = torch.Generator().manual_seed(seed)
    clone = make_tiny_model("llama")
    clone.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in clone.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen).to(p.device, p.dtype))
    return clone.to(next(model.parameters()).device)


@pytest.mark.parametrize("level", [1, 2])
def test_update_weights_is_visible_in_the_next_generation(level):
    base = make_tiny_model("llama")
    llm = LLM(base, enable_sleep_mode=True, block_size=4)
    before = run(llm)
    new = perturbed(base)
    llm.sleep(level)
    llm.wake_up()
    version = llm.llm_engine.weights_version
    llm.update_weights_from_model(new)
    assert llm.llm_engine.weights_version == version + 1
    got = run(llm)
    fresh = run(LLM(new, block_size=4))
    assert got[0] == fresh[0]
    torch.testing.assert_close(torch.tensor(sum(got[1], [])), torch.tensor(sum(fresh[1], [])), atol=1e-5, rtol=0)
    assert got[0] != before[0]
    assert_no_leak(llm)


def test_level2_refuses_to_generate_until_weights_arrive_and_loads_while_asleep():
    base = make_tiny_model("llama")
    llm = LLM(base, enable_sleep_mode=True)
    expected = run(llm)
    llm.sleep(2)
    with pytest.raises(ValueError, match="asleep"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.update_weights_from_model(base)  # while asleep: weights woken, then filled
    llm.wake_up(["kv_cache"])
    assert run(llm) == expected
    llm.sleep(2)
    llm.wake_up()
    with pytest.raises(ValueError, match="sleep\\(level=2\\)"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.load_weights(base.state_dict().items())
    assert run(llm) == expected


def test_sleep_twice_and_wake_while_awake_are_harmless_and_cycles_leak_nothing():
    base = make_tiny_model("llama")
    llm = LLM(base, enable_sleep_mode=True, block_size=4)
    expected = run(llm)
    llm.wake_up()
    for i in range(20):
        llm.sleep(1 + i % 2)
        llm.sleep(1)
        if i % 2:
            llm.update_weights_from_model(base)
        llm.wake_up()
        assert run(llm) == expected
    assert_no_leak(llm)
    with pytest.raises(ValueError, match="level"):
        llm.sleep(3)
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up(["everything"])


def test_sleep_needs_sleep_mode_and_no_requests_in_flight():
    llm = LLM(make_tiny_model("llama"))
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        llm.sleep(1)
    llm = LLM(make_tiny_model("llama"), enable_sleep_mode=True)
    llm.llm_engine.add_request("r", [1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="in flight"):
        llm.sleep(1)
    llm.llm_engine.abort_request("r")
    llm.sleep(1)
    assert_no_leak(llm)


def test_prefix_cache_is_reset_on_wake():
    llm = LLM(make_tiny_model("llama"), enable_sleep_mode=True, block_size=4)
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.llm_engine.block_manager.hash_to_block_id
    llm.sleep(1)
    llm.wake_up()
    assert not llm.llm_engine.block_manager.hash_to_block_id


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cumem", "recapture"])
def test_gpu_sleep_frees_memory_and_graphs_survive(backend):
    model = make_tiny_model("llama", hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=2).cuda()
    llm = LLM(model, enable_sleep_mode=True, gpu_memory_utilization=0.3, sleep_mode_backend=backend)
    engine = llm.llm_engine
    assert engine.worker.use_cumem == (backend == "cumem")
    expected = run(llm)
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    report = llm.memory_report()
    engine_bytes = report["weights_bytes"] + report["kv_cache_bytes"]
    llm.sleep(2)
    freed = torch.cuda.mem_get_info()[0] - free0
    assert freed >= 0.95 * engine_bytes, (freed, report)
    llm.update_weights_from_model(model)
    llm.wake_up()
    assert run(llm) == expected  # graphs replayed over the woken memory
    free_after = torch.cuda.mem_get_info()[0]
    for _ in range(20):
        llm.sleep(1)
        llm.wake_up()
    assert run(llm) == expected
    assert abs(torch.cuda.mem_get_info()[0] - free_after) <= 0.01 * torch.cuda.mem_get_info()[1]
    assert_no_leak(llm)
    t0 = time.perf_counter()
    llm.sleep(1)
    llm.wake_up()
    print(f"{backend}: sleep(1)+wake {time.perf_counter() - t0:.3f}s")
