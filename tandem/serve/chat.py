"""POST /v1/chat/completions: messages rendered through the chat template, as `LLM.chat` does."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tandem.engine.request_stream import RequestStream
from tandem.outputs import CompletionOutput
from tandem.serve.errors import APIError
from tandem.serve.protocol import ChatCompletionRequest, ChatMessage, TokenizeRequest
from tandem.serve.serving import (
    HOLE,
    OpenAIServing,
    disconnected_response,
    finite,
    new_id,
    now,
    prompt_logprobs_json,
    sse,
    sse_template,
    token_str,
    usage,
)


class OpenAIServingChat(OpenAIServing):
    request_fields = frozenset(ChatCompletionRequest.model_fields)

    def __init__(self, *args, chat_template: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.chat_template = chat_template

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_request(req)
        text = await self._render_text(req)
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        rid = new_id("chatcmpl")

        def build(ids: list[int]) -> list:
            params = self.make_params(req, ids, field, logprobs, "messages")
            return [(rid, {"prompt": text, "prompt_token_ids": ids}, params)]

        ids, stream = await self.encode_and_submit(
            text, "messages", "delta" if req.stream else "final_only", build,
            add_special_tokens=False,
        )
        if req.stream:
            return self.event_stream(self._events(req, rid, stream, ids), stream)
        finals = await self.run_to_end(raw, stream)
        if finals is None:
            return disconnected_response()
        out = finals[0]
        choices = []
        for c in out.outputs:
            choice = {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": _logprobs(c, req.top_logprobs) if req.logprobs else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if req.return_token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        body = {
            "id": rid,
            "object": "chat.completion",
            "created": now(),
            "model": self.model_name,
            "choices": choices,
            "usage": usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs),
                           out.num_cached_tokens),
        }
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
        if req.return_token_ids:
            body["prompt_token_ids"] = out.prompt_token_ids
        return JSONResponse(body)

    async def _render(self, req: ChatCompletionRequest | TokenizeRequest) -> dict:
        """The prompt text and ids, exactly as `LLM.chat` makes them."""
        text = await self._render_text(req)
        return {
            "prompt": text,
            "prompt_token_ids": await self.encode(text, "messages", add_special_tokens=False),
        }

    async def _render_text(self, req: ChatCompletionRequest | TokenizeRequest) -> str:
        """The prompt text, the chat template applied as `LLM.chat` does."""
        tok = self.llm.tokenizer
        if tok is None:
            raise APIError(
                "messages: this model has no tokenizer, so there is no chat template; send "
                "token ids to /v1/completions instead, or start the server with --tokenizer",
                param="messages",
                code="no_tokenizer",
            )
        template = self.chat_template or getattr(tok, "chat_template", None)
        if not template:
            raise APIError(
                "messages: the tokenizer has no chat template; start the server with "
                "--chat-template",
                param="messages",
                code="no_chat_template",
            )
        conversation = [_message_dict(i, m) for i, m in enumerate(req.messages)]
        self.check_prompt_chars(sum(len(m["content"] or "") for m in conversation), "messages")
        try:
            text = await self.llm.run_tokenizer(
                tok.apply_chat_template,
                conversation,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
                continue_final_message=req.continue_final_message,
                **({"tools": req.tools} if getattr(req, "tools", None) else {}),
            )
        # A template is code that the input runs: its failures are the input's.
        except Exception as e:  # noqa: BLE001
            raise APIError(
                f"messages: the chat template failed: {type(e).__name__}: {e}",
                param="messages",
                code="chat_template_error",
            ) from None
        return text

    async def _events(
        self, req: ChatCompletionRequest, rid: str, stream: RequestStream, prompt_ids: list[int]
    ) -> AsyncIterator[str]:
        created = now()
        num_prompt = len(prompt_ids)
        num_generated = 0
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        # chunks of content alone (most of a stream) are filled into a template per choice
        plain = not (req.logprobs or req.return_token_ids or continuous)
        templates: dict[int, Callable[[str], str]] = {}

        def chunk(choices: list[dict]) -> dict:
            c = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_name,
                "choices": choices,
            }
            if continuous:
                c["usage"] = usage(num_prompt, num_generated)
            return c

        for j in range(req.n):
            first = {
                "index": j,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            if req.return_token_ids:
                first["prompt_token_ids"] = prompt_ids
            yield sse(chunk([first]))
        done: set[int] = set()
        cached = 0
        async for _, out in stream:
            cached = out.num_cached_tokens
            for c in out.outputs:
                if c.index in done or not (c.token_ids or c.text or c.finish_reason):
                    continue
                if c.finish_reason is not None:
                    done.add(c.index)
                num_generated += len(c.token_ids)
                if plain and c.finish_reason is None and c.stop_reason is None:
                    if c.index not in templates:  # the general choice, its content left open
                        choice = _choice(req, c)
                        choice["delta"]["content"] = HOLE
                        templates[c.index] = sse_template(chunk([choice]))
                    yield templates[c.index](c.text)
                    continue
                yield sse(chunk([_choice(req, c)]))
        if req.include_usage:
            final = chunk([])
            final["usage"] = usage(num_prompt, num_generated, cached)
            yield sse(final)


def _choice(req: ChatCompletionRequest, c: CompletionOutput) -> dict:
    """One streamed choice: the sample's new content, with its logprobs, token ids and finish
    as the request asked."""
    choice = {
        "index": c.index,
        "delta": {"content": c.text},
        "logprobs": _logprobs(c, req.top_logprobs) if req.logprobs else None,
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
    }
    if req.return_token_ids:
        choice["token_ids"] = c.token_ids
    return choice


def _message_dict(i: int, m: ChatMessage) -> dict:
    content = m.content
    if content is None:  # an assistant turn of tool calls only (the OpenAI SDK sends null)
        content = ""
    elif isinstance(content, list):  # content parts: text only, joined as vLLM does
        texts = []
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise APIError(
                    f"messages.{i}.content.{j}: only text parts are supported, got "
                    f"type {part.type!r}",
                    param="messages",
                    code="unsupported",
                )
            texts.append(part.text)
        content = "\n".join(texts)
    return {**(m.model_extra or {}), "role": m.role, "content": content}


def _logprobs(c: CompletionOutput, k: int | None) -> dict:
    """The chat format: per token its text, logprob, UTF-8 bytes and the top `k` alternatives."""
    content = []
    for token_id, entry in zip(c.token_ids, c.logprobs or []):
        lp = entry.get(token_id)
        tok = token_str(token_id, lp)
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
        top = [
            _entry(token_str(t, alt), alt.logprob)
            for t, alt in ranked
            if alt.rank is not None and alt.rank <= (k or 0)
        ]
        item = _entry(tok, lp.logprob if lp is not None else float("-inf"))
        item["top_logprobs"] = top
        content.append(item)
    return {"content": content}


def _entry(tok: str, logprob: float) -> dict:
    return {"token": tok, "logprob": finite(logprob), "bytes": list(tok.encode("utf-8"))}
