"""StepInputBuilder (ModelRunner.prepare_inputs): the flat step tensors, built on the host and
moved in one copy."""


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
    import torch

    from tandem.engine.block_manager import BlockManager
    from tandem.engine.sequence import Sequence
    from tandem.engine.step_inputs import StepInputBuilder
    from tandem.sampling_params import SamplingParams

    builder = StepInputBuilder(4, torch.device("cpu"))
    bm = BlockManager(64, 4, enable_prefix_caching=False)

    def seq(n):
        return Sequence(list(range(n)), SamplingParams(), "r", 0, None, 128, frozenset())

    seqs = [seq(5), seq(9), seq(2)]
    for s in seqs:
        bm.allocate(s, [], s.num_tokens)

    def expected(batch):
        width = max(len(s.block_table) for s in batch)
        return [s.block_table + [0] * (width - len(s.block_table)) for s in batch]

    assert builder.block_tables(seqs).tolist() == expected(seqs)
    seqs[2].num_computed_tokens = 2
    bm.append_slots(seqs[2], 7)  # grows past the others
    assert builder.block_tables(seqs).tolist() == expected(seqs)
    before = list(seqs[1].block_table)
    bm.deallocate(seqs[1])  # preempted; another sequence takes its blocks
    bm.allocate(seq(9), [], 9)
    bm.allocate(seqs[1], [], 9)  # readmitted in the same place: same length, other blocks
    assert seqs[1].block_table != before and len(seqs[1].block_table) == len(before)
    assert builder.block_tables(seqs).tolist() == expected(seqs)
    assert builder.block_tables(seqs[1:]).tolist() == expected(seqs[1:])  # another batch


def _reference(sched, prev, bs):
    """Each row's inputs written out one token at a time, from the sequences themselves."""
    ids, positions, slots, qsl, lens, sample_rows = [], [], [], [0], [], []
    for seq, k, samples in zip(sched.seqs, sched.num_new_tokens, sched.sampling):
        a = seq.num_computed_tokens
        for pos in range(a, a + k):
            ids.append(seq.token_ids[pos] if pos < len(seq.token_ids) else int(prev[seq.pending_row]))
            positions.append(pos)
            slots.append(seq.block_table[pos // bs] * bs + pos % bs)
        qsl.append(qsl[-1] + k)
        lens.append(a + k)
        if samples:
            sample_rows.append(qsl[-1] - 1)
    width = max(len(s.block_table) for s in sched.seqs)
    tables = [s.block_table + [0] * (width - len(s.block_table)) for s in sched.seqs]
    return ids, positions, slots, qsl, lens, tables, sample_rows


def test_step_inputs_match_a_row_by_row_reference():
    """Random batches over consecutive steps (so the kept block tables are exercised): prompt
    chunks, decodes, 1-token chunks of longer prompts, rows whose last input is the in-flight
    step's placeholder, decode windows; every tensor as the rows say, every part 16-byte
    aligned."""
    import random

    import torch

    from tandem.engine.scheduler import SchedulerOutput
    from tandem.engine.sequence import Sequence
    from tandem.engine.step_inputs import StepInputBuilder
    from tandem.sampling_params import SamplingParams

    bs, rng = 4, random.Random(0)
    builder = StepInputBuilder(bs, torch.device("cpu"))
    next_block = iter(range(1, 10**6))
    pool = []
    for i in range(12):
        seq = Sequence([rng.randrange(1000) for _ in range(rng.randrange(1, 30))], SamplingParams(), f"r{i}")
        pool.append(seq)
    for step in range(300):
        if step % 5 == 0:  # a new batch; the same sequences (and kept block tables) in between
            batch = rng.sample(pool, rng.randrange(1, 7))
        K = rng.choice([1, 1, 2, 4])
        sched = SchedulerOutput(num_steps=1)
        prev = torch.tensor([rng.randrange(1000, 2000) for _ in range(8)])
        if rng.random() < 0.3:  # after a window: the in-flight tokens are a strided column
            prev = torch.stack([prev, prev + 1], dim=1)[:, 1]
        steady = rng.random() < 0.4  # a steady decode: every row's input is in flight...
        order = rng.sample(range(len(batch)), len(batch)) if rng.random() < 0.5 else range(len(batch))
        for row, seq in enumerate(batch):
            seq.drop_placeholder()
            if steady:  # ...in the same row of the in-flight step, or another
                if seq.num_computed_tokens < len(seq.token_ids):  # caught up first
                    seq.num_computed_tokens = len(seq.token_ids)
                seq.append_placeholder(order[row])
            elif rng.random() < 0.3:  # the in-flight step is sampling this row's next token
                seq.append_placeholder(rng.randrange(8))
            remaining = seq.num_tokens - seq.num_computed_tokens
            if remaining <= 0:  # caught up: the next token is known, decode it
                seq.token_ids.append(rng.randrange(1000))
                seq.num_tokens += 1
                remaining = 1
            k = rng.randrange(1, remaining + 1) if rng.random() < 0.5 else 1
            sched.add(seq, k)
        if K > 1 and sched.is_decode_only:
            sched.num_steps = K
        horizon = [s.num_computed_tokens + k + sched.num_steps for s, k in zip(sched.seqs, sched.num_new_tokens)]
        for seq, h in zip(sched.seqs, horizon):
            if rng.random() < 0.05 and seq.block_table:  # rewritten in place (preempted, readmitted)
                seq.block_table[:] = [next(next_block) for _ in seq.block_table]
                seq.block_table_epoch += 1
            while len(seq.block_table) * bs < h:
                seq.block_table.append(next(next_block))
        x = builder.build(sched, prev)
        ids, positions, slots, qsl, lens, tables, sample_rows = _reference(sched, prev, bs)
        where = f"step {step}"
        assert x.input_ids.tolist() == ids, where
        assert x.positions.tolist() == positions, where
        assert x.meta.slot_mapping.tolist() == slots, where
        assert x.meta.query_start_loc.tolist() == qsl and x.meta.query_start_loc_cpu == qsl, where
        assert x.meta.seq_lens.tolist() == lens and x.meta.seq_lens_cpu == lens, where
        assert x.meta.block_tables.tolist() == tables, where
        assert x.meta.query_start_loc.dtype == x.meta.seq_lens.dtype == x.meta.block_tables.dtype == torch.int32
        assert x.meta.max_seq_len == max(lens) and x.meta.max_query_len == max(sched.num_new_tokens)
        assert x.sample_rows == sample_rows, where
        for t in (x.input_ids, x.positions, x.meta.slot_mapping, x.meta.query_start_loc, x.meta.seq_lens,
                  x.meta.block_tables):
            assert t.data_ptr() % 16 == 0, where
        if sched.num_steps > 1:
            w = x.window
            for k in range(sched.num_steps):
                want_pos = [s.num_computed_tokens + k for s in sched.seqs]
                assert w.positions[k].tolist() == want_pos, where
                assert w.slot_mapping[k].tolist() == [s.block_table[p // bs] * bs + p % bs
                                                      for s, p in zip(sched.seqs, want_pos)], where
                assert w.seq_lens[k].tolist() == [p + 1 for p in want_pos] == w.seq_lens_cpu[k].tolist(), where
                assert w.positions[k].data_ptr() % 16 == 0 and w.slot_mapping[k].data_ptr() % 16 == 0
        else:
            assert x.window is None
        for seq, k in zip(sched.seqs, sched.num_new_tokens):  # the step ran: its tokens are computed
            seq.num_computed_tokens = min(seq.num_computed_tokens + k, len(seq.token_ids))


def test_a_one_token_chunk_of_a_longer_prompt_beside_decodes_reads_its_own_token():
    """A token budget of one row more than the running decodes makes a decode-shaped step that
    holds a 1-token chunk of a waiting prompt: that row's input is the prompt's token at its
    position, not the prompt's last token. The greedy outputs equal an unconstrained run's."""
    from model_fixtures import make_tiny_model

    from tandem import LLM, SamplingParams

    model = make_tiny_model("llama")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 33, 8, 91]}, {"prompt_token_ids": [12, 3, 44, 9, 100, 7, 61]}]
    want = [o.outputs[0].token_ids for o in LLM(model).generate(prompts, params, use_tqdm=False)]
    tight = LLM(model, max_num_batched_tokens=2, max_num_seqs=2, block_size=4)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert got == want
