"""POST /v1/completions: prompts as text or token ids, streamed or not, `n` samples each."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tandem.engine.request_stream import RequestStream
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.serve.errors import APIError
from tandem.serve.protocol import CompletionRequest
from tandem.serve.serving import (
    OpenAIServing,
    disconnected_response,
    finite,
    new_id,
    now,
    token_str,
    usage,
)


class OpenAIServingCompletion(OpenAIServing):
    request_fields = frozenset(CompletionRequest.model_fields)

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_request(req)
        prompts = [await self._tokenize(p) for p in req.prompts()]
        params = [
            self.make_params(req, p["prompt_token_ids"], "max_tokens", req.logprobs, "prompt")
            for p in prompts
        ]
        base = new_id("cmpl")
        requests = [(f"{base}-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        stream = self.submit(requests, "delta" if req.stream else "final_only")
        if req.stream:
            num_prompt = sum(len(p["prompt_token_ids"]) for p in prompts)
            return self.event_stream(self._events(req, base, stream, num_prompt), stream)
        finals = await self.run_to_end(raw, stream)
        if finals is None:
            return disconnected_response()
        return JSONResponse(self._response(req, base, finals))

    async def _tokenize(self, prompt: str | list[int]) -> dict:
        if not isinstance(prompt, str):
            return {"prompt": None, "prompt_token_ids": list(prompt)}
        if self.llm.tokenizer is None:
            raise APIError(
                "prompt: this model has no tokenizer, so text prompts cannot be encoded; send "
                "token ids (a list of integers) instead, or start the server with --tokenizer",
                param="prompt",
                code="no_tokenizer",
            )
        return {"prompt": prompt, "prompt_token_ids": await self.encode(prompt, "prompt")}

    def _echo(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        tok = self.llm.tokenizer
        return tok.decode(out.prompt_token_ids) if tok is not None else ""

    def _choice(
        self,
        req: CompletionRequest,
        i: int,
        out: RequestOutput,
        c: CompletionOutput,
        text: str,
        offset: int,
    ) -> dict:
        choice = {
            "index": i * req.n + c.index,
            "text": text,
            "logprobs": _logprobs(c, offset) if req.logprobs is not None else None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if req.return_token_ids:
            choice["token_ids"] = c.token_ids
        return choice

    def _response(self, req: CompletionRequest, rid: str, finals: list[RequestOutput]) -> dict:
        choices = []
        for i, out in enumerate(finals):
            echo = self._echo(out) if req.echo else ""
            for c in out.outputs:
                choice = self._choice(req, i, out, c, echo + c.text, len(echo))
                if req.return_token_ids:
                    choice["prompt_token_ids"] = out.prompt_token_ids
                choices.append(choice)
        num_generated = sum(len(c.token_ids) for out in finals for c in out.outputs)
        num_prompt = sum(len(out.prompt_token_ids) for out in finals)
        return {
            "id": rid,
            "object": "text_completion",
            "created": now(),
            "model": self.model_name,
            "choices": choices,
            "usage": usage(num_prompt, num_generated),
        }

    async def _events(
        self, req: CompletionRequest, rid: str, stream: RequestStream, num_prompt: int
    ) -> AsyncIterator[dict]:
        created = now()
        num_generated = 0
        offsets: dict[int, int] = {}  # choice -> characters sent so far (logprobs' text_offset)
        done: set[int] = set()
        async for i, out in stream:
            for c in out.outputs:
                index = i * req.n + c.index
                if index in done or not (c.token_ids or c.text or c.finish_reason):
                    continue  # a sample that finished earlier, or had no token this step
                if c.finish_reason is not None:
                    done.add(index)
                num_generated += len(c.token_ids)
                text = c.text
                first = index not in offsets
                if first and req.echo:
                    text = self._echo(out) + text
                offset = offsets.get(index, 0) + len(text) - len(c.text)
                choice = self._choice(req, i, out, c, text, offset)
                offsets[index] = offset + len(c.text)
                if first and req.return_token_ids:
                    choice["prompt_token_ids"] = out.prompt_token_ids
                chunk = {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": self.model_name,
                    "choices": [choice],
                }
                if req.stream_options and req.stream_options.continuous_usage_stats:
                    chunk["usage"] = usage(num_prompt, num_generated)
                yield chunk
        if req.include_usage:
            yield {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [],
                "usage": usage(num_prompt, num_generated),
            }


def _logprobs(c: CompletionOutput, offset: int) -> dict:
    """The legacy completions format: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_logprobs, top, text_offset = [], [], [], []
    for token_id, entry in zip(c.token_ids, c.logprobs or []):
        tok = token_str(token_id, entry.get(token_id))
        tokens.append(tok)
        token_logprobs.append(finite(entry[token_id].logprob) if token_id in entry else None)
        top.append({token_str(t, lp): finite(lp.logprob) for t, lp in entry.items()})
        text_offset.append(offset)
        offset += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": text_offset,
    }
