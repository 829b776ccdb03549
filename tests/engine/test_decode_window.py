"""Decode windows (`num_scheduler_steps`): several decode steps launched per scheduling round,
each step's sampled tokens the next one's inputs on the device, read back and booked at once.

A window changes when the host sees tokens, never which tokens come: every test runs the same work
with num_scheduler_steps=1 and 4 and compares what a user sees. Seeded rows draw from (seed, token
count) keys, so sampled runs compare exactly too. Windows must also have really run (a test that
never opens one would pass trivially), and every KV block must come back.
"""

import pytest
from model_fixtures import assert_no_leak, make_tiny_model, record_schedules

from tandem import LLM, SamplingParams

PROMPTS = [list(range(3, 3 + k)) for k in (5, 17, 9, 30, 2, 11)]


def _summary(outputs):
    return [[(c.token_ids, [next(iter(d.values())).logprob for d in c.logprobs or []], c.finish_reason,
              c.stop_reason, c.cumulative_logprob) for c in o.outputs] for o in outputs]


def _ends(summary):
    """Each sample's tokens, finish reason and stop reason."""
    return [[(c[0], c[2], c[3]) for c in o] for o in summary]


def _run(model, prompts, params, steps, **kw):
    """(what the user sees, the window sizes the scheduler chose) for one engine."""
    llm = LLM(model, num_scheduler_steps=steps, block_size=4, **kw)
    scheduled = record_schedules(llm)
    outs = _summary(llm.generate(prompts, params, use_tqdm=False))
    assert_no_leak(llm)
    _run.preemptions = llm.llm_engine.scheduler.num_preemptions
    return outs, [s.num_steps for s in scheduled]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("params", [
    [SamplingParams(temperature=0, max_tokens=9 + 3 * i, ignore_eos=True) for i in range(6)],
    [SamplingParams(temperature=0.9, top_k=50, seed=11 + i, n=2, max_tokens=14 + i, ignore_eos=True,
                    logprobs=0) for i in range(6)],
], ids=["greedy", "seeded-n2-logprobs"])
def test_windows_sample_exactly_what_single_steps_do(params, async_scheduling):
    single, ones = _run(make_tiny_model("qwen2"), PROMPTS, params, 1, async_scheduling=async_scheduling)
    window, sizes = _run(make_tiny_model("qwen2"), PROMPTS, params, 4, async_scheduling=async_scheduling)
    assert set(ones) == {1} and max(sizes) == 4
    # every row runs the same batches (a window never crosses a row's token limit): bit for bit
    assert window == single
    lengths = [len(c[0]) for o in window for c in o]
    assert lengths == [p.max_tokens for p in params for _ in range(p.n)]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_stop_token_inside_a_window_ends_the_sample_there(async_scheduling):
    model = make_tiny_model("llama")
    free = _run(model, PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), 1)[0]
    # tokens each prompt produces at different depths, so samples stop mid-window, at different steps
    stops = sorted({o[0][0][k] for o, k in zip(free, (2, 5, 7, 11, 3, 9))})
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=stops, logprobs=0)
    single, _ = _run(model, PROMPTS, params, 1, async_scheduling=async_scheduling)
    window, sizes = _run(model, PROMPTS, params, 4, async_scheduling=async_scheduling)
    assert max(sizes) == 4
    assert _ends(window) == _ends(single)
    stopped = [c for o in window for c in o if c[2] == "stop"]
    assert stopped and all(c[0][-1] in stops and c[3] == c[0][-1] for c in stopped)
    # (a sample that stopped inside a window ran beside rows that single steps had dropped: its
    # logprobs may differ in the last bits on a CPU, whose GEMMs depend on the batch size)
    for w, s in zip(window, single):
        for cw, cs in zip(w, s):
            assert cw[1] == pytest.approx(cs[1], abs=1e-5)


def test_min_tokens_are_met_before_a_window_opens():
    model = make_tiny_model("llama")
    free = _run(model, PROMPTS[:3], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), 1)[0]
    stops = sorted({o[0][0][1] for o in free})  # tokens the samples produce early
    params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=stops, min_tokens=6)
    single, _ = _run(model, PROMPTS[:3], params, 1)
    window, sizes = _run(model, PROMPTS[:3], params, 4)
    assert _ends(window) == _ends(single)
    assert all(len(c[0]) >= 6 for o in window for c in o)
    assert max(sizes) == 4


def test_min_tokens_without_stop_ids_leave_windows_open():
    """ignore_eos with min_tokens = max_tokens (what `tandem bench serve` and vLLM's benchmark
    send): no token can end the sample early, so min_tokens bans nothing and windows run."""
    params = [SamplingParams(temperature=0, max_tokens=9 + 3 * i, min_tokens=9 + 3 * i, ignore_eos=True)
              for i in range(6)]
    single, _ = _run(make_tiny_model("qwen2"), PROMPTS, params, 1)
    window, sizes = _run(make_tiny_model("qwen2"), PROMPTS, params, 4)
    assert max(sizes) == 4
    assert window == single


def test_windows_run_only_with_decode_window_min_seqs_sequences():
    """decode_window_min_seqs=4 (a server's max_num_seqs, say): windows while at least 4 of the 6
    samples decode, single steps once fewer are left; what the samples hold is unchanged."""
    params = [SamplingParams(temperature=0, max_tokens=9 + 3 * i, ignore_eos=True) for i in range(6)]
    single, _ = _run(make_tiny_model("qwen2"), PROMPTS, params, 1)
    llm = LLM(make_tiny_model("qwen2"), num_scheduler_steps=4, decode_window_min_seqs=4, block_size=4)
    scheduled = record_schedules(llm)
    assert _summary(llm.generate(PROMPTS, params, use_tqdm=False)) == single
    assert_no_leak(llm)
    rows = [(len(s.seqs), s.num_steps) for s in scheduled if s.is_decode_only]
    assert max(n for _, n in rows) == 4 and all(rows_ >= 4 for rows_, n in rows if n > 1)
    assert any(rows_ < 4 for rows_, _ in rows)  # the tail ran step by step
    # with the default (1) the same tail runs in windows too
    _, sizes = _run(make_tiny_model("qwen2"), PROMPTS, params, 4)
    assert sizes[-1] > 1 or sizes[-2] > 1


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=12, logprobs=2),
], ids=["top-logprobs"])
def test_rows_whose_sampling_reads_each_token_never_run_in_a_window(params):
    single, _ = _run(make_tiny_model("qwen2"), PROMPTS, params, 1)
    window, sizes = _run(make_tiny_model("qwen2"), PROMPTS, params, 4)
    assert set(sizes) == {1}
    assert window == single


def test_a_waiting_request_joins_at_the_next_step_not_after_a_window():
    llm = LLM(make_tiny_model("qwen2"), num_scheduler_steps=4, block_size=4)
    eng = llm.llm_engine
    steps = record_schedules(llm)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    eng.add_request("a", PROMPTS[0], params)
    for _ in range(3):
        eng.step()
    assert [s.num_steps for s in steps] == [1, 4, 4]  # the prefill, then windows
    eng.add_request("b", PROMPTS[1], params)
    eng.step()
    assert steps[-1].num_steps == 1 and len(steps[-1].seqs) == 2  # b's prefill joins at once
    while eng.has_unfinished_requests():
        eng.step()
    assert steps[-3].num_steps == 4 or max(s.num_steps for s in steps[4:]) == 4  # windows again
    assert_no_leak(llm)


def test_windows_filled_blocks_register_only_their_known_tokens():
    """A window books its tokens' KV before their ids are back; a block is registered in the
    prefix cache once its ids are known, so a later prompt that extends the output hits blocks
    holding exactly its tokens and continues as the first run did."""
    model = make_tiny_model("qwen2")
    llm = LLM(model, num_scheduler_steps=4, block_size=4, async_scheduling=True)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    first = llm.generate([PROMPTS[1]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    bm = llm.llm_engine.block_manager
    hits = bm.num_prefix_hits
    extended = PROMPTS[1] + list(first[:15])  # 32 tokens: 8 full blocks, 3 of them generated
    rest = llm.generate([extended], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    assert bm.num_prefix_hits - hits == 28  # 7 blocks (the last token is always computed)
    assert list(rest) == list(first[15:24])
    for block in bm.blocks:
        if block.hash is not None:
            assert len(block.token_ids) == 4
    assert_no_leak(llm)


def test_an_abort_inside_a_window_returns_every_block():
    llm = LLM(make_tiny_model("qwen2"), num_scheduler_steps=8, block_size=4, async_scheduling=True)
    eng = llm.llm_engine
    for i, p in enumerate(PROMPTS):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng._in_flight is not None and eng._in_flight[0].num_steps == 8
    eng.abort_request([str(i) for i in range(len(PROMPTS))])
    while eng.has_unfinished_requests() or eng._in_flight is not None:
        eng.step()
    assert_no_leak(llm)


def test_streamed_deltas_of_windows_add_up_to_the_output():
    llm = LLM(make_tiny_model("qwen2"), num_scheduler_steps=4, block_size=4)
    eng = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=17, ignore_eos=True)
    eng.add_request("r", PROMPTS[2], params, "delta")
    got = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            got += out.outputs[0].token_ids
    ref = LLM(make_tiny_model("qwen2"), block_size=4).generate([PROMPTS[2]], params, use_tqdm=False)
    assert got == list(ref[0].outputs[0].token_ids)


def test_num_scheduler_steps_is_checked():
    from tandem.config import EngineConfig

    with pytest.raises(ValueError, match="num_scheduler_steps"):
        EngineConfig(num_scheduler_steps=0)
    with pytest.raises(ValueError, match="decode_window_min_seqs"):
        EngineConfig(decode_window_min_seqs=0)
    with pytest.raises(ValueError, match=r"decode_window_min_seqs \(9\) must be at most max_num_seqs \(8\)"):
        EngineConfig(max_num_seqs=8, decode_window_min_seqs=9)


def test_every_step_of_a_window_reads_16_byte_aligned_inputs():
    """Triton specializes on pointer alignment: a window's step k must not start off 16 bytes
    when the batch size is odd (an eager step would compile another kernel variant mid-run)."""
    llm = LLM(make_tiny_model("qwen2"), num_scheduler_steps=4, block_size=4)
    eng = llm.llm_engine
    for i in range(3):
        eng.add_request(str(i), PROMPTS[i], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    eng.step()  # the prefills
    sched = eng.scheduler.schedule()
    assert sched.num_steps == 4 and len(sched.seqs) == 3
    ids, positions, meta, _, window = eng.worker.model_runner.prepare_inputs(sched)
    starts = [s.num_computed_tokens for s in sched.seqs]
    for k in range(4):
        step = window.meta(meta, k)
        for t in (window.positions[k], step.slot_mapping, step.seq_lens):
            assert t.data_ptr() % 16 == 0 and t.shape == (3,)
        assert window.positions[k].tolist() == [a + k for a in starts]
        assert step.seq_lens.tolist() == step.seq_lens_cpu == [a + k + 1 for a in starts]
        tables = meta.block_tables.tolist()
        assert step.slot_mapping.tolist() == [tables[r][(a + k) // 4] * 4 + (a + k) % 4 for r, a in enumerate(starts)]
    eng.scheduler.update_from_output(sched)
    for seq in sched.seqs:
        seq.drop_placeholder()
    eng.abort_request(["0", "1", "2"])
    assert_no_leak(llm)


def test_a_window_takes_no_blocks_it_cannot_have_and_preemption_still_works():
    """With too few KV blocks for everyone, single steps preempt; a window that would need more
    blocks than are free is not opened (never worth a preemption). Greedy outputs stay the same."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(num_gpu_blocks_override=40, max_num_seqs=6, max_model_len=64)
    single, _ = _run(make_tiny_model("qwen2"), PROMPTS, params, 1, **kw)
    assert _run.preemptions > 0
    window, sizes = _run(make_tiny_model("qwen2"), PROMPTS, params, 4, **kw)
    assert _run.preemptions > 0
    assert _ends(window) == _ends(single)
    assert max(sizes) == 4 and 1 in sizes[2:]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("include", [False, True], ids=["stop-str-cut", "stop-str-kept"])
def test_stop_strings_end_a_sample_inside_a_window_where_single_steps_do(async_scheduling, include):
    """Stop strings are matched in the text token by token, so a window's later tokens are dropped
    where single steps would not have sampled them, the text cut at the same place; a window that
    reaches max_tokens exactly does not end its sample early (its later tokens are placeholders
    while the earlier ones are checked)."""
    from model_fixtures import make_tokenizer

    model, tok = make_tiny_model("llama"), make_tokenizer()
    free = LLM(model, tokenizer=tok, block_size=4).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    # a piece of text each sample writes at a different depth, and one no sample writes
    stops = [o.outputs[0].text[k:k + 2] for o, k in zip(free, (3, 9, 14, 5, 20, 1)) if len(o.outputs[0].text) > k + 2]
    cut = SamplingParams(temperature=0, max_tokens=16, stop=stops, ignore_eos=True,
                         include_stop_str_in_output=include)
    never = SamplingParams(temperature=0, max_tokens=16, stop=["\x00never"], ignore_eos=True)
    outs = {}
    for steps in (1, 4):
        llm = LLM(model, tokenizer=tok, block_size=4, num_scheduler_steps=steps, async_scheduling=async_scheduling)
        scheduled = record_schedules(llm)
        outs[steps] = [[(c.token_ids, c.text, c.finish_reason, c.stop_reason)
                        for o in llm.generate(PROMPTS, p, use_tqdm=False) for c in o.outputs] for p in (cut, never)]
        assert max(s.num_steps for s in scheduled) == steps
        assert_no_leak(llm)
    assert outs[4] == outs[1]
    assert {c[2] for c in outs[1][0]} == {"stop"} and {c[2] for c in outs[1][1]} == {"length"}
    assert all(len(c[0]) == 16 for c in outs[4][1])


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_penalties_count_a_windows_tokens_on_the_device(async_scheduling):
    """Repetition, presence and frequency penalties read the output's token counts: inside a
    window they grow on the device step by step, so the samples are the single steps'."""
    params = [SamplingParams(temperature=0.8, seed=5 + i, max_tokens=14, ignore_eos=True, repetition_penalty=1.5,
                             presence_penalty=0.7, frequency_penalty=0.4, logprobs=0) for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, repetition_penalty=2.0)
    for p in (params, greedy):
        single, _ = _run(make_tiny_model("qwen2"), PROMPTS, p, 1, async_scheduling=async_scheduling)
        window, sizes = _run(make_tiny_model("qwen2"), PROMPTS, p, 4, async_scheduling=async_scheduling)
        assert max(sizes) == 4
        assert window == single
    free, _ = _run(make_tiny_model("qwen2"), PROMPTS, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True), 4)
    assert _ends(free) != _ends(window)  # the penalty changed what was sampled


@pytest.mark.gpu
@pytest.mark.parametrize("params", [
    [SamplingParams(temperature=0, max_tokens=40 + 3 * i, ignore_eos=True) for i in range(6)],
    [SamplingParams(temperature=1.0, top_p=0.9, seed=5 + i, n=3, max_tokens=33 + i, ignore_eos=True,
                    logprobs=0) for i in range(6)],
], ids=["greedy", "seeded-n3-top-p-logprobs"])
def test_gpu_windows_with_cuda_graphs_sample_what_single_steps_do(params):
    """On the GPU, windows replay the decode graphs back to back: the tokens and their logprobs are
    the single steps' (the same batch shapes, so the same kernels: bit for bit)."""
    import torch

    model = make_tiny_model("qwen2", max_position_embeddings=1024).to("cuda", torch.bfloat16)
    # a KV cache sized for the test (0.2 of an H200 is millions of 4-token blocks to set up)
    kw = dict(gpu_memory_utilization=0.2, num_gpu_blocks_override=4096, max_num_seqs=32)
    single, ones = _run(model, PROMPTS, params, 1, **kw)
    window, sizes = _run(model, PROMPTS, params, 8, **kw)
    assert set(ones) == {1} and max(sizes) == 8
    assert window == single


def test_windows_are_on_by_default_on_cuda_and_only_with_a_full_batch_in_a_server(tiny_llama_dir):
    """None: windows of 4 where the host runs ahead of the device (CUDA), single steps on a CPU;
    behind a server they run only with the batch full (decode_window_min_seqs = max_num_seqs),
    when no arriving prompt could join anyway."""
    import torch

    from tandem.config import EngineConfig
    from tandem.engine.async_llm import AsyncLLM

    cuda = torch.cuda.is_available()
    model = make_tiny_model("llama").to("cuda" if cuda else "cpu")
    llm = LLM(model, **({"gpu_memory_utilization": 0.2} if cuda else {}))
    assert llm.llm_engine.config.num_scheduler_steps == (4 if cuda else 1)
    assert LLM(model, num_scheduler_steps=2, **({"gpu_memory_utilization": 0.2} if cuda else {})
               ).llm_engine.config.num_scheduler_steps == 2
    assert llm.llm_engine.scheduler.decode_window_min_seqs == 1
    # the server's engines (tandem serve's, one API server or several): a config of their own
    assert EngineConfig(num_scheduler_steps=3).for_serving().num_scheduler_steps == 3
    assert EngineConfig(max_num_seqs=64, decode_window_min_seqs=2).for_serving().decode_window_min_seqs == 2
    served = EngineConfig(model=tiny_llama_dir, max_num_seqs=8, **({"gpu_memory_utilization": 0.2} if cuda else {}))
    online = AsyncLLM(served, engine_mode="thread")
    try:
        engine = online.engine_core.engine
        assert engine.config.num_scheduler_steps == (4 if cuda else 1)
        assert engine.scheduler.decode_window_min_seqs == 8
        assert served.num_scheduler_steps is None and served.decode_window_min_seqs is None
    finally:
        online.shutdown()
