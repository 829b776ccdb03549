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
    ids, positions, meta, _, window = eng.worker.model_runner.prepare_inputs(sched)
    assert window is None
    assert ids.shape[0] == 12
    for t in (ids, positions, meta.slot_mapping):
        assert t.data_ptr() % 16 == 0
    assert positions.tolist() == list(range(7)) + list(range(5))
    assert ids.tolist() == list(range(3, 10)) + list(range(3, 8))
    eng.abort_request(list(eng.requests))


def test_block_tables_kept_between_steps_follow_every_change():
    """The runner keeps its block-table array while the batch holds the same sequences and
    rewrites only rows that grew; a table emptied and refilled to the same length (preemption,
    then readmission in the same order) is rebuilt, not served stale."""
    from tandem.engine.block_manager import BlockManager
    from tandem.engine.model_runner import ModelRunner
    from tandem.engine.sequence import Sequence
    from tandem.sampling_params import SamplingParams

    runner = ModelRunner.__new__(ModelRunner)  # only the block-table cache is exercised
    runner._block_table_cache = None
    bm = BlockManager(64, 4, enable_prefix_caching=False)

    def seq(n):
        return Sequence(list(range(n)), SamplingParams(), "r", 0, None, 128, frozenset())

    seqs = [seq(5), seq(9), seq(2)]
    for s in seqs:
        bm.allocate(s, [], s.num_tokens)

    def expected(batch):
        width = max(len(s.block_table) for s in batch)
        return [s.block_table + [0] * (width - len(s.block_table)) for s in batch]

    assert runner._block_tables(seqs).tolist() == expected(seqs)
    seqs[2].num_computed_tokens = 2
    bm.append_slots(seqs[2], 7)  # grows past the others
    assert runner._block_tables(seqs).tolist() == expected(seqs)
    before = list(seqs[1].block_table)
    bm.deallocate(seqs[1])  # preempted; another sequence takes its blocks
    bm.allocate(seq(9), [], 9)
    bm.allocate(seqs[1], [], 9)  # readmitted in the same place: same length, other blocks
    assert seqs[1].block_table != before and len(seqs[1].block_table) == len(before)
    assert runner._block_tables(seqs).tolist() == expected(seqs)
    assert runner._block_tables(seqs[1:]).tolist() == expected(seqs[1:])  # another batch
