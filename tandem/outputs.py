"""What `LLM.generate` returns: RequestOutput holding one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one candidate token, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per generated position: token id -> Logprob.
SampleLogprobs = list[dict[int, Logprob]]


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
