"""Prefix caching shares blocks; preemption under a tiny KV cache still finishes identically."""

from model_fixtures import assert_no_leak, make_tiny_model

from tandem import LLM, SamplingParams


def test_n_samples_hold_the_prompt_blocks_once():
    llm = LLM(make_tiny_model("llama"), block_size=4)
    engine = llm.llm_engine
    prompt = list(range(10, 27))  # 17 tokens: 4 full blocks
    engine.add_request("r", prompt, SamplingParams(n=8, max_tokens=6, temperature=1.0, ignore_eos=True))
    held = None
    while engine.has_unfinished_requests():
        engine.step()
        running = engine.scheduler.running
        if len(running) == 8 and held is None:
            held = [s.block_table[:4] for s in running]
    assert held is not None and all(t == held[0] for t in held)
    assert engine.block_manager.blocks[held[0][0]].hash is not None
    assert_no_leak(llm)


def test_repeated_prompt_hits_the_cache():
    llm = LLM(make_tiny_model("qwen2"), block_size=4)
    prompt = list(range(30, 50))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 16
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_no_leak(llm)


def test_preemption_keeps_outputs_identical():
    model = make_tiny_model("llama")
    prompts = [list(range(i, i + 13)) for i in range(0, 60, 10)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    roomy = LLM(model, block_size=4)
    ref = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    # 11 blocks of 4 = 44 tokens: one 43-token sequence fits, six never fit at once
    tight = LLM(model, block_size=4, num_gpu_blocks_override=11, max_model_len=44,
                enable_prefix_caching=False)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert got == ref
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert_no_leak(tight)
    assert_no_leak(roomy)


def test_preemption_with_prefix_cache_and_sampling_seeds():
    model = make_tiny_model("llama")
    prompts = [list(range(5, 18))] * 4
    params = SamplingParams(temperature=0.9, max_tokens=25, seed=5, n=2, ignore_eos=True)
    ref = LLM(model, block_size=4).generate(prompts, params, use_tqdm=False)
    tight = LLM(model, block_size=4, num_gpu_blocks_override=12, max_model_len=48)
    got = tight.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in ref]
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert_no_leak(tight)
