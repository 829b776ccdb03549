"""Request bodies of the OpenAI API (plus vLLM's extra sampling fields), validated by pydantic.

Range checks live here so that a bad value is rejected with the field's name before anything
reaches the engine; `sampling_params()` maps a validated request onto `SamplingParams`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator

from tandem.sampling_params import SamplingParams, StructuredOutputsParams
from tandem.serve.errors import APIError

MAX_N = 128  # OpenAI's own bound on `n`
MAX_LOGPROBS = 20
MAX_STOP = 64  # stop strings per request (each of any length)
_INT64 = 2**63
TokenIds = list[StrictInt]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-_INT64, lt=_INT64)
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = Field(None, max_length=1024)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = (
        False  # vLLM: token ids beside the text (the only output without a tokenizer)
    )
    user: str | None = None
    logit_bias: dict[str, float] | None = Field(None, max_length=1024)  # token id -> bias
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_* fields
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's extra field

    @field_validator("stop")
    @classmethod
    def _stop_count(cls, value):
        if isinstance(value, list) and len(value) > MAX_STOP:  # a limit on the list, not a string
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(value)}")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(16, ge=0)  # 0 with echo: score the prompt, generate nothing
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_shape(cls, value: Any, handler):
        try:
            prompt = handler(value)
        except ValidationError:
            raise ValueError(
                "must be a string, a list of strings, a list of token ids or a list of "
                "token-id lists"
            ) from None
        if isinstance(prompt, list) and (not prompt or any(p in ([], "") for p in prompt)):
            raise ValueError("must not be empty")
        return prompt

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens=0`: the prompt and its logprobs, nothing generated (vLLM runs
        it as max_tokens=1 and drops the token)."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (one text or one token-id list each)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ...: passed to the template
    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body: a prompt, or chat messages rendered through the chat template."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True  # (a prompt only: a rendered template has its own)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: TokenIds = Field(max_length=1 << 20)


def reject_unsupported(req: _SamplingRequest) -> None:
    """Fields we parse but do not implement (an error naming them beats ignoring them), and the
    combinations vLLM refuses."""
    unsupported = {
        "suffix": getattr(req, "suffix", None) is not None,
        "best_of": getattr(req, "best_of", None) not in (None, req.n),
        # no tool-call parser: tools only as context for the template, with tool_choice="none"
        "tools": bool(getattr(req, "tools", None)) and getattr(req, "tool_choice", None) != "none",
    }
    for name, used in unsupported.items():
        if used:
            hint = ""
            if name == "tools":
                hint = '; send tool_choice="none" to give the model the tools as context'
            raise APIError(
                f"{name} is not supported by this server{hint}", param=name, code="unsupported"
            )
    if req.stream_options is not None and not req.stream:
        raise APIError("stream_options can only be given when stream=true", param="stream_options")
    if isinstance(req, CompletionRequest) and req.max_tokens == 0 and not req.echo:
        raise APIError("max_tokens=0 needs echo=true (it scores the prompt)", param="max_tokens")
    if isinstance(req, ChatCompletionRequest) and req.top_logprobs and not req.logprobs:
        raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest, max_tokens: int, logprobs: int | None
) -> SamplingParams:
    """SamplingParams for a validated request (raises ValueError naming the field)."""

    def pick(value, default):
        return default if value is None else value

    so = structured_outputs(req)
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None and getattr(req, "echo", False):
        prompt_logprobs = logprobs  # the echoed prompt carries logprobs like the output (vLLM)

    return SamplingParams(
        logit_bias=logit_bias(req.logit_bias),
        structured_outputs=so,
        n=req.n,
        temperature=pick(req.temperature, 1.0),
        top_p=pick(req.top_p, 1.0),
        top_k=pick(req.top_k, 0),
        min_p=pick(req.min_p, 0.0),
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        seed=req.seed,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        repetition_penalty=pick(req.repetition_penalty, 1.0),
        presence_penalty=pick(req.presence_penalty, 0.0),
        frequency_penalty=pick(req.frequency_penalty, 0.0),
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
    )


def logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's {"token id": bias}, each bias clamped to [-100, 100] as OpenAI and vLLM do."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(f"logit_bias: keys must be token ids, got {key!r}",
                           param="logit_bias") from None
        out[token] = min(100.0, max(-100.0, value))
    return out


def structured_outputs(req: _SamplingRequest) -> StructuredOutputsParams | None:
    """The request's output constraint, from whichever field carries it (one at most)."""
    found = _constraints(req)
    if not found:
        return None
    (param, spec), = found.items()
    fields = StructuredOutputsParams.__dataclass_fields__
    unknown = sorted(set(spec) - set(fields))
    if unknown:
        raise APIError(f"{param}: unknown fields {unknown}; known: {sorted(fields)}", param=param)
    try:
        return StructuredOutputsParams(**spec)
    except (TypeError, ValueError) as e:
        raise APIError(f"{param}: {e}", param=param) from None


def constraint_field(req: _SamplingRequest) -> str:
    """The field that carries the request's output constraint (response_format, structured_outputs
    or a guided_* one): what an error about the constraint names."""
    found = _constraints(req)
    return next(iter(found)) if len(found) == 1 else "structured_outputs"


def _constraints(req: _SamplingRequest) -> dict[str, dict]:
    """{field: StructuredOutputsParams' keyword arguments} for each field that carries one (a 400
    for more than one, or a response_format that is not a constraint tandem takes)."""
    found: dict[str, dict] = {}
    rf = req.response_format
    kind = (rf or {}).get("type", "text")
    if kind == "json_object":
        found["response_format"] = {"json_object": True}
    elif kind == "json_schema":
        schema = (rf.get("json_schema") or {}).get("schema")
        if not isinstance(schema, (dict, str)):
            raise APIError("response_format: json_schema needs a schema, as "
                           '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
                           param="response_format")
        found["response_format"] = {"json": schema}
    elif kind != "text":
        raise APIError(f"response_format: type {kind!r} is not supported; use text, json_object "
                       "or json_schema", param="response_format", code="unsupported")
    if req.structured_outputs:
        found["structured_outputs"] = req.structured_outputs
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{name}")
        if value is not None:
            found[f"guided_{name}"] = {name: value}
    if len(found) > 1:
        raise APIError(f"give one output constraint, not {sorted(found)}", param=sorted(found)[1])
    return found
