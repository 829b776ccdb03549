"""ModelRunner.prepare_inputs: the flat step tensors, built on the host and moved in one copy."""


def test_step_inputs_start_16_byte_aligned():
    """Kernels read positions and slot mapping in place; Triton specializes on pointer alignment,
    so an odd token count must not move them off 16 bytes (that compiled new variants mid-serving)."""
    from model_fixtures import make_tiny_model

    from tandem import LLM, SamplingParams

    llm = LLM(make_tiny_model("qwen2"), block_size=16)
    eng = llm.llm_engine
    eng.add_request(None, list(range(3, 10)), SamplingParams(max_tokens=2), "final_only")  # 7 tokens
    eng.add_request(None, list(range(3, 8)), SamplingParams(max_tokens=2), "final_only")  # 5 tokens
    sched = eng.scheduler.schedule()
    ids, positions, meta, _ = eng.model_runner.prepare_inputs(sched)
    assert ids.shape[0] == 12
    for t in (ids, positions, meta.slot_mapping):
        assert t.data_ptr() % 16 == 0
    assert positions.tolist() == list(range(7)) + list(range(5))
    assert ids.tolist() == list(range(3, 10)) + list(range(3, 8))
    eng.abort_request(list(eng.requests))
