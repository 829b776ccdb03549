"""Scheduler in plain Python: continuous batching, chunked prefill, preemption, sibling sharing."""

from tandem.engine.block_manager import BlockManager
from tandem.engine.scheduler import Scheduler
from tandem.engine.sequence import Sequence
from tandem.sampling_params import SamplingParams


def make(num_blocks=64, block_size=4, max_num_seqs=8, max_tokens=32, chunked=True):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(bm, max_num_seqs, max_tokens, chunked), bm


def run_step(sched, out, token=7):
    """Pretend the model ran: advance counts and append a token where the step samples."""
    sched.update_from_output(out)
    for s, samples in zip(out.seqs, out.sampling):
        if samples:
            s.fill_placeholder(token, 0.0)


def test_prefill_then_decode_then_new_arrivals_join():
    sched, _ = make()
    a = Sequence(list(range(10)), SamplingParams())
    sched.add(a)
    out = sched.schedule()
    assert out.num_new_tokens == [10] and out.sampling == [True]
    run_step(sched, out)
    b = Sequence(list(range(50, 55)), SamplingParams())
    sched.add(b)
    out = sched.schedule()
    # the running decode goes first, then the newcomer's prefill joins the same step
    assert out.seqs == [a, b] and out.num_new_tokens == [1, 5]
    assert not out.is_decode_only


def test_chunked_prefill_respects_token_budget():
    sched, _ = make(max_tokens=8)
    a = Sequence(list(range(20)), SamplingParams())
    sched.add(a)
    chunks = []
    while True:
        out = sched.schedule()
        chunks.append(out.num_new_tokens[0])
        last = out.sampling[0]
        run_step(sched, out)
        if last:
            break
    assert chunks == [8, 8, 4]
    assert a.num_output_tokens == 1


def test_no_chunking_waits_for_budget():
    sched, _ = make(max_tokens=8, chunked=False)
    sched.add(Sequence(list(range(6)), SamplingParams()))
    sched.add(Sequence(list(range(6)), SamplingParams()))
    out = sched.schedule()
    assert out.num_new_tokens == [6]


def test_max_num_seqs_bounds_the_batch():
    sched, _ = make(max_num_seqs=2)
    for _ in range(4):
        sched.add(Sequence([1, 2, 3], SamplingParams()))
    out = sched.schedule()
    assert len(out.seqs) == 2 and len(sched.waiting) == 2


def test_preemption_frees_newest_and_recomputes_later():
    sched, bm = make(num_blocks=4, block_size=2)
    a = Sequence([1, 2, 3], SamplingParams())
    b = Sequence([4, 5, 6], SamplingParams())
    sched.add(a)
    sched.add(b)
    run_step(sched, sched.schedule())  # both prefilled: 2 blocks each, all 4 used
    run_step(sched, sched.schedule())  # 4th token of each still fits
    assert bm.num_free_blocks == 0
    out = sched.schedule()  # a's 5th token needs a third block: b (newest) is preempted
    assert out.num_preempted == 1
    assert out.seqs == [a]
    assert b.num_computed_tokens == 0 and sched.waiting[0] is b
    assert sched.num_preemptions == 1


def test_samples_of_one_prompt_wait_for_leader_then_share_blocks():
    sched, bm = make(block_size=4)
    params = SamplingParams(n=3)
    leader = Sequence(list(range(10)), params, "r", 0)
    sibs = [Sequence(list(range(10)), params, "r", i, leader) for i in (1, 2)]
    for s in [leader, *sibs]:
        sched.add(s)
    out = sched.schedule()
    assert out.seqs == [leader]
    run_step(sched, out)
    out = sched.schedule()
    assert out.seqs[1:] == sibs
    # the siblings reuse the leader's two full blocks and compute only the tail
    assert out.num_new_tokens == [1, 2, 2]
    for s in sibs:
        assert s.block_table[:2] == leader.block_table[:2]


def test_finish_frees_blocks_and_abort_of_waiting():
    sched, bm = make()
    a = Sequence([1, 2, 3], SamplingParams())
    b = Sequence([1, 2, 3], SamplingParams())
    sched.add(a)
    sched.add(b)
    sched.max_num_seqs = 1
    run_step(sched, sched.schedule())
    sched.finish(a, "stop")
    sched.finish(b, "abort")
    assert not sched.has_unfinished()
    assert bm.num_free_blocks == bm.num_blocks


def test_admission_delay_gathers_arrivals_off_graph_steps():
    """With max_admission_delay_steps, prompts arriving while the batch only decodes wait up to
    that many steps and then join together; they join at once in a burst (as many waiting as
    running) and when half a step's token budget waits."""
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, 8, 32, True, max_admission_delay_steps=3)  # joins at 16 waiting tokens
    running = [Sequence(list(range(i, i + 4)), SamplingParams()) for i in range(4)]
    for seq in running:
        sched.add(seq)
    out = sched.schedule()
    assert out.seqs == running  # an idle engine admits at once
    run_step(sched, out)
    b, c = Sequence(list(range(50, 55)), SamplingParams()), Sequence(list(range(60, 64)), SamplingParams())
    sched.add(b)
    for arrival in (c, None, None):
        out = sched.schedule()
        assert out.seqs == running and out.is_decode_only  # held: decode-only steps
        run_step(sched, out)
        if arrival is not None:
            sched.add(arrival)
    out = sched.schedule()  # the fourth step: both join together
    assert out.seqs == running + [b, c] and out.num_new_tokens == [1, 1, 1, 1, 5, 4]
    run_step(sched, out)
    big = Sequence(list(range(100, 117)), SamplingParams())  # 17 tokens >= 16: no wait
    sched.add(big)
    assert sched.schedule().seqs[-1] is big
    burst = Scheduler(BlockManager(64, 4), 8, 32, True, max_admission_delay_steps=3)
    first = Sequence(list(range(4)), SamplingParams())
    burst.add(first)
    run_step(burst, burst.schedule())
    late = [Sequence(list(range(10, 13)), SamplingParams()), Sequence(list(range(20, 23)), SamplingParams())]
    for seq in late:
        burst.add(seq)  # two waiting, one running (waiting >= 1.2 x running): a burst, no wait
    assert burst.schedule().seqs == [first] + late


def test_admission_delay_never_holds_siblings_or_a_prefilling_step():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, 8, 64, True, max_admission_delay_steps=5)
    a = Sequence(list(range(10)), SamplingParams())
    sched.add(a)
    run_step(sched, sched.schedule())
    sibling = Sequence(list(range(10)), SamplingParams(), leader=a)  # a sample of a's prompt
    sched.add(sibling)
    assert sched.schedule().seqs[-1] is sibling
    sched2 = Scheduler(BlockManager(64, 4), 8, 12, True, max_admission_delay_steps=5)
    long = Sequence(list(range(20)), SamplingParams())  # chunked over two steps
    sched2.add(long)
    run_step(sched2, sched2.schedule())
    new = Sequence(list(range(30, 32)), SamplingParams())
    sched2.add(new)
    out = sched2.schedule()  # long's second chunk makes this step prefill anyway: new joins
    assert out.seqs == [long, new]
