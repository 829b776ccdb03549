"""Sequence: one sample being generated, its tokens, its KV blocks and its progress."""

from __future__ import annotations

import enum
import itertools
import time

from tandem.engine.token_fsm import FSMCursor
from tandem.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Sequence:
    """Prompt plus generated tokens of one sample.

    `num_computed_tokens` counts tokens whose KV is in the cache; the tokens after it are what the
    next step must run. A decode step runs one token (the last sampled), a prefill chunk many.

    With async scheduling a step is launched before the previous step's tokens are back: the
    token being sampled counts in `num_tokens` as a placeholder (vLLM's
    `num_output_placeholders`), never in `token_ids`, which holds real ids only. The next step
    reads its id on the device, from row `pending_row` of the in-flight step's output.
    """

    _counter = itertools.count()

    def __init__(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str = "",
        index: int = 0,
        leader: "Sequence | None" = None,
        max_model_len: int | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
    ):
        self.seq_id = next(Sequence._counter)
        self.request_id = request_id
        self.index = index  # which of the request's n samples this is
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.leader = leader  # sibling whose prompt prefill this one waits for, to share its blocks
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first schedule
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of full blocks, by content
        self.num_registered_blocks = 0  # leading blocks already offered to the prefix cache
        # bumped whenever the block table is emptied (finish, preemption): until then it only grows,
        # so a row of the model runner's block-table array stays valid while (seq_id, epoch) holds
        self.block_table_epoch = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.cumulative_logprob = 0.0
        self.output_logprobs: list[float] = []  # logprob of each sampled token
        # When sampling_params.logprobs is set: each sampled token's rank, and with logprobs > 0
        # its top-k alternatives {token: (logprob, rank)}. Flat lists, not a dict per token: the
        # hot loop allocates nothing the cyclic collector has to walk.
        self.output_ranks: list[int] = []
        self.top_logprobs: list[dict[int, tuple[float, int]]] = []
        # With sampling_params.prompt_logprobs (the request's first sample only): for each prompt
        # position p computed so far, the logprob and rank of prompt token p + 1 given tokens
        # 0..p, and its top-k alternatives [(token, logprob)]. While they are incomplete the
        # prefill may not start from the prefix cache (a cached block keeps KV, not logits), as
        # in vLLM; a plain flag, read for every sequence of every step.
        self.wants_prompt_logprobs = (sampling_params.prompt_logprobs is not None and index == 0
                                      and self.num_prompt_tokens > 1)
        self.prompt_lps: list[float] = []
        self.prompt_ranks: list[int] = []
        self.prompt_tops: list[list[tuple[int, float]]] = []
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.output_text = ""
        self.generator = None  # torch.Generator for a seeded request, made on first sample
        self.matcher = None  # llguidance LLMatcher with sampling_params.structured_outputs, or...
        self.fsm = None  # ...its token automaton's cursor (tandem.engine.token_fsm.FSMCursor)
        self.grammar_stop: tuple[str, None] | None = None  # set once the grammar is complete
        self.num_placeholders = 0  # tokens sampled by the in-flight step, not read back yet
        # Tokens so far, the in-flight step's included: len(token_ids) + num_placeholders, kept
        # as the two change (the scheduler and the read-back read it for every row every step).
        self.num_tokens = len(self.token_ids)
        self.pending_row = -1  # row of the in-flight step's sampled tokens holding the placeholder
        # Limits checked every step, computed once.
        limits = [max_model_len] if max_model_len is not None else []
        if sampling_params.max_tokens is not None:
            limits.append(self.num_prompt_tokens + sampling_params.max_tokens)
        self.max_num_tokens = min(limits, default=1 << 62)
        self.eos_ids = frozenset() if sampling_params.ignore_eos else frozenset(eos_token_ids)
        self.stop_ids = self.eos_ids | frozenset(sampling_params.stop_token_ids)  # tokens that end it
        # Whether several decode steps may run before the host sees their tokens (a decode
        # window, `Scheduler._decode_window`): its sampling needs nothing of the window's tokens on
        # the host (no llguidance grammar, no top-k logprob lists; penalties count them and token
        # automata step on the device), and the host can judge afterwards where it ended (stop
        # tokens, stop strings, max_tokens, a grammar complete). min_tokens is checked as it grows.
        p = sampling_params
        self._no_logprob_lists = p.logprobs is None or p.logprobs == 0
        self.windowable = p.structured_outputs is None and self._no_logprob_lists
        # Whether a sampled token needs more of the host than its id and the stop-id and length
        # checks: logprobs to record, stop strings to match, a grammar to step. Most rows need
        # nothing more, and the read-back of every step skips the rest for them.
        self.has_token_hooks = (p.logprobs is not None or bool(p.stop_strings)
                                or p.structured_outputs is not None)

    def set_grammar(self, grammar) -> None:
        """Constrain the sample: an llguidance matcher, or a token automaton's cursor (which
        steps on the device, so the sample may still decode in windows)."""
        if isinstance(grammar, FSMCursor):
            self.fsm = grammar
            self.windowable = self._no_logprob_lists
        else:
            self.matcher = grammar

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def stop_tokens_banned(self) -> bool:
        """Whether this step's sampling must ban the stop ids (min_tokens not yet met and there
        are some: with ignore_eos and no stop_token_ids, min_tokens bans nothing)."""
        return bool(self.stop_ids) and self.num_output_tokens < self.sampling_params.min_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def in_prompt_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def has_placeholder(self) -> bool:
        return self.num_placeholders > 0

    def append_placeholder(self, row: int, count: int = 1) -> None:
        """Count the tokens the in-flight step is sampling (row `row` of its output; `count` of
        them in a decode window) as generated."""
        self.num_placeholders += count
        self.num_tokens += count
        self.pending_row = row

    def drop_placeholder(self) -> None:
        self.num_tokens -= self.num_placeholders
        self.num_placeholders = 0

    def fill_placeholder(self, token_id: int, logprob: float) -> None:
        """Record the sampled id of the token counted as a placeholder when its step launched."""
        self.token_ids.append(token_id)
        self.num_placeholders -= 1
        self.output_logprobs.append(logprob)
        self.cumulative_logprob += logprob
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def fill_placeholders(self, token_ids: list[int], logprobs: list[float]) -> None:
        """`fill_placeholder` for several tokens of a decode window at once, in order."""
        self.token_ids += token_ids
        self.num_placeholders -= len(token_ids)
        self.output_logprobs += logprobs
        total = self.cumulative_logprob
        for lp in logprobs:  # in order, as token by token (sum() compensates: other bits)
            total += lp
        self.cumulative_logprob = total
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, request={self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table}, {self.status.name})"
        )
