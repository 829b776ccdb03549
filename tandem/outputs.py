"""What `LLM.generate` returns: RequestOutput holding one CompletionOutput per sample."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one candidate token, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class FlatLogprobs(Sequence):
    """A sample's logprobs as flat lists (vLLM's FlatLogprobs): position i is the dict
    {token id: Logprob} of entries start_indices[i]:end_indices[i], made when it is read. A
    rollout of 256 x 256 tokens as dicts is 131k objects the cyclic GC walks in every full pass
    until they are freed; these are six lists. The sampled token is each position's first entry."""

    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    decoded_tokens: list[str | None] = field(default_factory=list)

    def append(self, position: dict[int, Logprob]) -> None:
        self.start_indices.append(len(self.token_ids))
        for token_id, lp in position.items():
            self.token_ids.append(token_id)
            self.logprobs.append(lp.logprob)
            self.ranks.append(lp.rank)
            self.decoded_tokens.append(lp.decoded_token)
        self.end_indices.append(len(self.token_ids))

    def extend(self, positions) -> None:
        """Append every position of `positions` (another FlatLogprobs: list by list, no dicts)."""
        if not isinstance(positions, FlatLogprobs):
            for position in positions:
                self.append(position)
            return
        shift = len(self.token_ids)
        self.start_indices += [a + shift for a in positions.start_indices]
        self.end_indices += [b + shift for b in positions.end_indices]
        self.token_ids += positions.token_ids
        self.logprobs += positions.logprobs
        self.ranks += positions.ranks
        self.decoded_tokens += positions.decoded_tokens

    def __len__(self) -> int:
        return len(self.start_indices)

    def __getitem__(self, i):
        if isinstance(i, slice):
            out = FlatLogprobs()
            out.extend(self[j] for j in range(*i.indices(len(self))))
            return out
        a, b = self.start_indices[i], self.end_indices[i]
        return {self.token_ids[j]: Logprob(self.logprobs[j], self.ranks[j], self.decoded_tokens[j])
                for j in range(a, b)}

    def __add__(self, other):
        out = FlatLogprobs()
        out.extend(self)
        out.extend(other)
        return out

    def __radd__(self, other):  # list + this (and list += this, which Python routes here): a list
        return [*other, *self]

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and not isinstance(other, str) and list(self) == list(other)


# One entry per generated position: token id -> Logprob.
SampleLogprobs = FlatLogprobs | list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __reduce__(self):
        """Pickled as the class and its positional arguments (finish and stop reason left out
        while both are None, as they are in every streamed delta but the last). The default
        pickle of a dataclass is its __dict__, keys and all: with RequestOutput's `__reduce__`
        this made a step's outputs (256 deltas of 8 tokens) 52 -> 42 KB, pickling 20% and
        unpickling 45% cheaper (a micro-benchmark, 2026-12-02). A field added here must be added
        to the tuple (tests/engine/test_output_pickle.py checks); a subclass that adds fields
        must override it."""
        args = (self.index, self.text, self.token_ids, self.cumulative_logprob, self.logprobs,
                self.finish_reason, self.stop_reason)
        if self.stop_reason is None:
            args = args[:6] if self.finish_reason is not None else args[:5]
        return type(self), args


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)

    def __reduce__(self):
        """Pickled as the class and its positional arguments (see CompletionOutput's); this is
        what the engine core sends the API process for every streamed output."""
        return type(self), (self.request_id, self.prompt, self.prompt_token_ids, self.outputs,
                            self.finished, self.prompt_logprobs, self.num_cached_tokens,
                            self.metrics)

    def add(self, next_output: RequestOutput) -> None:
        """Fold a later delta output of the same request into this one (vLLM's aggregating
        `RequestOutput.add`): text, token ids and logprobs appended, finish state taken over."""
        mine = {c.index: c for c in self.outputs}
        for nxt in next_output.outputs:
            c = mine.get(nxt.index)
            if c is None:
                self.outputs.append(nxt)
                continue
            c.text += nxt.text
            c.token_ids = c.token_ids + nxt.token_ids
            if c.logprobs is not None and nxt.logprobs is not None:
                c.logprobs = c.logprobs + nxt.logprobs
            c.cumulative_logprob = nxt.cumulative_logprob
            c.finish_reason = nxt.finish_reason
            c.stop_reason = nxt.stop_reason
        self.finished = next_output.finished
