"""POST /v1/completions: prompts as text or token ids, streamed or not, `n` samples each."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tandem.engine.request_stream import RequestStream
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.serve.errors import APIError
from tandem.serve.protocol import CompletionRequest
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


class OpenAIServingCompletion(OpenAIServing):
    request_fields = frozenset(CompletionRequest.model_fields)

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_request(req)
        base = new_id("cmpl")
        output_kind = "delta" if req.stream else "final_only"
        texts = req.prompts()
        if len(texts) == 1 and isinstance(texts[0], str):  # one text: handed over once encoded
            text = texts[0]
            self._check_tokenizer()

            def build(ids: list[int]) -> list:
                params = self.make_params(req, ids, "max_tokens", req.logprobs, "prompt")
                return [(f"{base}-0", {"prompt": text, "prompt_token_ids": ids}, params)]

            ids, stream = await self.encode_and_submit(text, "prompt", output_kind, build)
            prompts = [{"prompt": text, "prompt_token_ids": ids}]
        else:
            prompts = [await self._tokenize(p) for p in texts]
            params = [
                self.make_params(req, p["prompt_token_ids"], "max_tokens", req.logprobs, "prompt")
                for p in prompts
            ]
            requests = [(f"{base}-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
            stream = self.submit(requests, output_kind)
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
        self._check_tokenizer()
        return {"prompt": prompt, "prompt_token_ids": await self.encode(prompt, "prompt")}

    def _check_tokenizer(self) -> None:
        if self.llm.tokenizer is None:
            raise APIError(
                "prompt: this model has no tokenizer, so text prompts cannot be encoded; send "
                "token ids (a list of integers) instead, or start the server with --tokenizer",
                param="prompt",
                code="no_tokenizer",
            )

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
        echo: bool,
        offset: int,
        prompt_lps: list | None = None,
    ) -> dict:
        """One choice: with `echo` (the choice's first chunk) the prompt's text, tokens and
        logprobs come first; with max_tokens=0 the token generated for it is dropped."""
        text, ids, entries = "", [], []
        if echo:
            text, ids = self._echo(out), list(out.prompt_token_ids)
            entries = list(prompt_lps or [None] * len(ids))
        if not req.echo_only:
            text += c.text
            ids += c.token_ids
            entries += c.logprobs or []
        logprobs = None
        if req.logprobs is not None:
            logprobs = _logprobs(ids, entries, offset, self._token_text)
        choice = {
            "index": i * req.n + c.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if req.return_token_ids:
            choice["token_ids"] = [] if req.echo_only else c.token_ids
        if req.prompt_logprobs is not None and prompt_lps is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(prompt_lps)
        return choice

    def _token_text(self, token_id: int) -> str:
        tok = self.llm.tokenizer
        return tok.decode([token_id]) if tok is not None else f"token_id:{token_id}"

    def _response(self, req: CompletionRequest, rid: str, finals: list[RequestOutput]) -> dict:
        choices = []
        for i, out in enumerate(finals):
            for c in out.outputs:
                choice = self._choice(req, i, out, c, req.echo, 0, out.prompt_logprobs)
                if req.return_token_ids:
                    choice["prompt_token_ids"] = out.prompt_token_ids
                choices.append(choice)
        num_generated = 0 if req.echo_only else sum(
            len(c.token_ids) for out in finals for c in out.outputs)
        num_prompt = sum(len(out.prompt_token_ids) for out in finals)
        num_cached = sum(out.num_cached_tokens for out in finals)
        return {
            "id": rid,
            "object": "text_completion",
            "created": now(),
            "model": self.model_name,
            "choices": choices,
            "usage": usage(num_prompt, num_generated, num_cached),
        }

    async def _events(
        self, req: CompletionRequest, rid: str, stream: RequestStream, num_prompt: int
    ) -> AsyncIterator[str]:
        created = now()
        num_generated = 0
        offsets: dict[int, int] = {}  # choice -> characters sent so far (logprobs' text_offset)
        done: set[int] = set()
        prompt_lps: dict[int, list | None] = {}  # prompt -> its logprobs (in its first output)
        cached: dict[int, int] = {}
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        n, echo_only = req.n, req.echo_only
        # chunks of text alone (most of a stream) are filled into a template per choice
        plain = not (req.logprobs is not None or req.return_token_ids or continuous or echo_only)
        plain_first = plain and not req.echo and req.prompt_logprobs is None
        templates: dict[int, Callable[[str], str]] = {}

        def chunk(choices: list[dict]) -> dict:
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": choices,
            }

        async for i, out in stream:
            if i not in prompt_lps:
                prompt_lps[i] = out.prompt_logprobs
                cached[i] = out.num_cached_tokens
            for c in out.outputs:
                index = i * n + c.index
                if index in done or not (c.token_ids or c.text or c.finish_reason):
                    continue  # a sample that finished earlier, or had no token this step
                if c.finish_reason is not None:
                    done.add(index)
                if not echo_only:
                    num_generated += len(c.token_ids)
                first = index not in offsets
                if ((plain_first if first else plain) and c.finish_reason is None
                        and c.stop_reason is None):
                    offsets[index] = offsets.get(index, 0) + len(c.text)
                    if index not in templates:  # the general choice, its text left open
                        choice = self._choice(req, i, out, c, False, 0)
                        choice["text"] = HOLE
                        templates[index] = sse_template(chunk([choice]))
                    yield templates[index](c.text)
                    continue
                choice = self._choice(req, i, out, c, first and req.echo, offsets.get(index, 0),
                                      prompt_lps[i] if first else None)
                offsets[index] = offsets.get(index, 0) + len(choice["text"])
                if first and req.return_token_ids:
                    choice["prompt_token_ids"] = out.prompt_token_ids
                event = chunk([choice])
                if continuous:
                    event["usage"] = usage(num_prompt, num_generated, sum(cached.values()))
                yield sse(event)
        if req.include_usage:
            event = chunk([])
            event["usage"] = usage(num_prompt, num_generated, sum(cached.values()))
            yield sse(event)


def _logprobs(token_ids: list[int], entries: list, offset: int, token_text) -> dict:
    """The legacy completions format: tokens, token_logprobs, top_logprobs, text_offset. An entry
    of None (the first prompt token: nothing predicts it) gives null logprobs, as in vLLM."""
    tokens, token_logprobs, top, text_offset = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        if entry is None:
            tok = token_text(token_id)
            token_logprobs.append(None)
            top.append(None)
        else:
            tok = token_str(token_id, entry.get(token_id))
            token_logprobs.append(finite(entry[token_id].logprob) if token_id in entry else None)
            top.append({token_str(t, lp): finite(lp.logprob) for t, lp in entry.items()})
        tokens.append(tok)
        text_offset.append(offset)
        offset += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": text_offset,
    }
