"""SamplingParams: how to pick tokens for one request (vLLM's names and meanings)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.checks import check_bool, check_float, check_int

_MAX_N = 2**16  # samples per prompt
_MAX_LOGPROBS = 2**20  # the engine's own limit (20) is checked where it is known


@dataclass
class StructuredOutputsParams:
    """What the output must match (vLLM's names): exactly one of a JSON schema, any JSON object,
    a regex, one of a list of strings, or a Lark grammar."""

    json: dict | str | None = None  # a JSON schema (a dict or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark syntax (llguidance's)
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON: compact separators only, no free whitespace

    def __post_init__(self) -> None:
        kinds = ("json", "regex", "choice", "grammar", "json_object")
        given = [k for k in kinds if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object; got {given or 'none'}"
            )
        if self.choice is not None and (not self.choice or any(
                not isinstance(c, str) or not c for c in self.choice)):
            raise ValueError(
                f"structured_outputs.choice must be non-empty strings, got {self.choice!r}")


@dataclass
class SamplingParams:
    """Sampling settings for one request; validated on construction.

    temperature 0 means greedy. `logprobs=k` returns, at each position, the log-probability of the
    sampled token and of the k most likely tokens (vLLM's convention); `prompt_logprobs=k` does the
    same for every prompt token after the first, from the raw (unprocessed) logits.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output (a grammar)
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        self.verify()

    def verify(self) -> None:
        """Every field's type and range (run again by the engine: a caller may have changed a
        field since); a TypeError or ValueError naming the field."""
        self.n = check_int("n", self.n, 1, _MAX_N)
        self.temperature = check_float("temperature", self.temperature, 0.0, 1e6)
        self.top_p = check_float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        self.top_k = check_int("top_k", self.top_k, -1, 2**31)
        if self.top_k == -1:
            self.top_k = 0
        self.min_p = check_float("min_p", self.min_p, 0.0, 1.0)
        self.max_tokens = check_int("max_tokens", self.max_tokens, 1, optional=True)
        self.min_tokens = check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        self.stop_strings = _stop_strings(self.stop)
        ids = self.stop_token_ids
        if ids is not None and not isinstance(ids, (list, tuple)):
            raise TypeError(f"stop_token_ids must be a list of token ids or None, got {ids!r}")
        self.stop_token_ids = [check_int("stop_token_ids", t, 0) for t in ids or []]
        check_bool("ignore_eos", self.ignore_eos)
        self.seed = check_int("seed", self.seed, 0, 2**63 - 2**16 - 1, optional=True)
        self.logprobs = check_int("logprobs", self.logprobs, 0, _MAX_LOGPROBS, optional=True)
        self.prompt_logprobs = check_int("prompt_logprobs", self.prompt_logprobs, 0, _MAX_LOGPROBS,
                                         optional=True)
        self.repetition_penalty = check_float(
            "repetition_penalty", self.repetition_penalty, 0.0, 1e6, lo_open=True
        )
        self.presence_penalty = check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        for name in ("skip_special_tokens", "include_stop_str_in_output", "detokenize"):
            check_bool(name, getattr(self, name))
        if self.stop_strings and not self.detokenize:
            raise ValueError("stop strings are matched in the detokenized text: stop needs "
                             f"detokenize=True (got stop={self.stop!r}, detokenize=False)")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise TypeError(
                    f"logit_bias must map token ids to biases, or be None, got {self.logit_bias!r}")
            self.logit_bias = {check_int("logit_bias", t, 0): check_float("logit_bias", b)
                               for t, b in self.logit_bias.items()}
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            raise TypeError("structured_outputs must be a StructuredOutputsParams or None")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def clone(self, **changes) -> "SamplingParams":
        kwargs = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "stop_strings"}
        kwargs.update(changes)
        return SamplingParams(**kwargs)


def _stop_strings(stop) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    elif not isinstance(stop, (list, tuple)):
        raise TypeError(f"stop must be a string, a list of strings or None, got {stop!r}")
    stop = list(stop)
    if any(not isinstance(s, str) or s == "" for s in stop):
        raise ValueError(f"stop must be non-empty strings, got {stop!r}")
    return stop
