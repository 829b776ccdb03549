"""Scheduler: continuous batching with chunked prefill, running sequences first, preemption."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tandem.engine.block_manager import BlockManager
from tandem.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """What one step runs: each sequence with the number of its tokens to compute now."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    # whether each sequence's chunk reaches its last token, so the step samples a token for it
    sampling: list[bool] = field(default_factory=list)
    num_preempted: int = 0
    # decode steps the step runs back to back (EngineConfig.num_scheduler_steps): each samples a
    # token per sequence that feeds the next on the device; the host books them all at once
    num_steps: int = 1

    def add(self, seq: Sequence, num_new: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new)
        self.sampling.append(seq.num_computed_tokens + num_new == seq.num_tokens)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def is_decode_only(self) -> bool:
        return self.total_tokens == len(self.seqs)  # every sequence runs >= 1 token


class Scheduler:
    """Decides each step which sequences run and how many tokens each computes.

    Running sequences go first (decodes and unfinished prefill chunks), in arrival order; waiting
    ones join while the token budget, `max_num_seqs` and free blocks allow. When blocks run out the
    newest running sequence is preempted: its blocks are freed and it is recomputed later.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        max_admission_delay_steps: int = 0,
        num_scheduler_steps: int = 1,
        decode_window_min_seqs: int = 1,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        # EngineConfig.max_admission_delay_steps: how long new prompts may be held back from a
        # decode-only step; they join at once when this many tokens wait
        self.max_admission_delay_steps = max_admission_delay_steps
        self.admission_batch_tokens = max(1, max_num_batched_tokens // 2)
        self.num_scheduler_steps = num_scheduler_steps
        self.decode_window_min_seqs = decode_window_min_seqs  # EngineConfig's: windows only at this batch
        self._held_steps = 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        # (this loop visits every running sequence every step: the block manager is called only
        # when a block is needed)
        running = self.running
        block_size = bm.block_size
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            num_tokens = seq.num_tokens
            if num_tokens >= seq.max_num_tokens:
                i += 1  # its in-flight token (async scheduling) is its last: nothing more to run
                continue
            computed = seq.num_computed_tokens
            num_new = num_tokens - computed
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    i += 1
                    continue
                num_new = budget
            needs_block = computed + num_new > len(seq.block_table) * block_size
            if needs_block and not self._append_or_preempt(seq, num_new, out):
                break  # the sequence itself was preempted: nothing after it fits either
            out.add(seq, num_new)
            budget -= num_new
            i += 1

        if out.num_preempted:
            return out  # memory is short: do not admit new work this step
        if (self.num_scheduler_steps > 1 and out.seqs and len(running) >= self.decode_window_min_seqs
                and (not self.waiting or len(running) >= self.max_num_seqs)):
            out.num_steps = self._decode_window(out)
            if out.num_steps > 1:
                return out  # nothing could join this step anyway
        if self.waiting and self._holds_admission(out):
            self._held_steps += 1
            return out
        self._held_steps = 0

        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self._waits_for_leader(seq):
                skipped.append(self.waiting.popleft())
                continue
            cached = bm.find_cached_blocks(seq)
            num_new = seq.num_tokens - len(cached) * bm.block_size
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            if not bm.can_allocate(seq, cached, num_new):
                break
            self.waiting.popleft()
            bm.allocate(seq, cached, num_new)
            if seq.num_cached_tokens == 0 and seq.num_output_tokens == 0:
                seq.num_cached_tokens = len(cached) * bm.block_size
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.add(seq, num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return out

    def _append_or_preempt(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        """Blocks for `seq`'s next `num_new` tokens, preempting the newest running sequences
        until they fit; False when `seq` itself had to go."""
        while not self.block_manager.try_append(seq, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            out.num_preempted += 1
            if victim is seq:
                return False
        return True

    def _decode_window(self, out: SchedulerOutput) -> int:
        """How many decode steps this decode-only step may run back to back (vLLM v0's
        multi-step scheduling): up to num_scheduler_steps, while no sequence's sampling needs the
        window's tokens on the host (`Sequence.windowable`: no grammars or top-k logprob lists;
        no stop ids banned for min_tokens (`Sequence.stop_tokens_banned`); penalties count them
        on the device), so the host can judge afterwards where each ended, and none reaches its
        token limit inside the window. The blocks for the window's tokens are taken now, all or
        none: a window is never worth a preemption."""
        if not out.is_decode_only or not all(out.sampling):  # (a 1-token prompt chunk samples nothing)
            return 1
        steps = self.num_scheduler_steps
        for seq in out.seqs:
            if not seq.windowable or seq.stop_tokens_banned:
                return 1
            steps = min(steps, seq.max_num_tokens - seq.num_tokens)
        if steps < 2:
            return 1
        bm = self.block_manager  # (the step's one input a sequence already has its block for)
        needed = sum(bm.blocks_needed(s.num_computed_tokens + steps) - len(s.block_table) for s in out.seqs)
        if needed > bm.num_free_blocks:
            return 1
        for seq in out.seqs:
            bm.try_append(seq, steps)
        return steps

    def _holds_admission(self, out: SchedulerOutput) -> bool:
        """Whether the waiting prompts stay out of this step, to join a later one together.

        Only a decode-only step is worth keeping so (it replays the cheapest graph; a step that
        already carries a prefill chunk costs more anyway), only for max_admission_delay_steps
        steps in a row, and never when enough tokens wait to fill half a step, when as many
        requests wait as run (a burst), or when the waiting ones are samples of a running prompt
        (they share its cached blocks and cost little)."""
        if self._held_steps >= self.max_admission_delay_steps or not out.seqs or not out.is_decode_only:
            return False
        if len(self.waiting) * 5 >= len(self.running) * 6:  # TGI's waiting_served_ratio, 1.2
            return False  # a burst: most of the work is still waiting
        tokens = 0
        for seq in self.waiting:
            if seq.leader is not None:
                return False
            tokens += seq.num_tokens - seq.num_computed_tokens
            if tokens >= self.admission_batch_tokens:
                return False
        return True

    def _waits_for_leader(self, seq: Sequence) -> bool:
        """Samples of one prompt wait for the first one's prefill, then share its cached blocks."""
        leader = seq.leader
        if leader is None or leader.is_finished or not self.block_manager.enable_prefix_caching:
            return False
        if seq.num_prompt_tokens <= self.block_manager.block_size:
            return False  # no full block to share
        return leader.in_prompt_prefill

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.deallocate(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def update_from_output(self, out: SchedulerOutput) -> None:
        """Book a launched step: advance computed-token counts, register blocks that became full,
        and count each token it samples as generated, a placeholder until its id is read back.
        Sequences that finished meanwhile (async scheduling) are skipped: their blocks are gone."""
        bm = self.block_manager
        block_size = bm.block_size
        running = SequenceStatus.RUNNING
        row = 0
        extra = out.num_steps - 1  # a window's later steps compute the tokens its earlier ones sample
        for seq, n, samples in zip(out.seqs, out.num_new_tokens, out.sampling):
            if seq.status is running:
                seq.num_computed_tokens += n + extra
                if seq.num_computed_tokens >= (seq.num_registered_blocks + 1) * block_size:
                    bm.cache_full_blocks(seq)  # (a block may have filled up: not every step)
                if samples:
                    seq.append_placeholder(row, out.num_steps)
            row += samples

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Mark a sequence done (stopped, length, aborted) and free its blocks (and its grammar's
        device slot)."""
        if seq.is_finished:
            return
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        seq.drop_placeholder()
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.deallocate(seq)
        if seq.fsm is not None:
            seq.fsm.release()  # its grammar's device slot
        seq.status = SequenceStatus.FINISHED
