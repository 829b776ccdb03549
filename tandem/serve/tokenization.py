"""vLLM's tokenizer routes: POST /tokenize, POST /detokenize, GET /tokenizer_info (what
lm-eval's `tokenizer_backend=remote` reads)."""

from __future__ import annotations

from tandem.serve.chat import OpenAIServingChat
from tandem.serve.errors import APIError
from tandem.serve.protocol import DetokenizeRequest, TokenizeRequest


class OpenAIServingTokenization:
    def __init__(self, chat: OpenAIServingChat):
        self.chat = chat  # renders messages exactly as /v1/chat/completions does
        self.llm = chat.llm

    def _tokenizer(self, req: TokenizeRequest | DetokenizeRequest | None = None):
        if req is not None and req.model is not None and req.model != self.chat.model_name:
            raise APIError(
                f"model {req.model!r} does not exist; this server serves {self.chat.model_name!r}",
                404, param="model", code="model_not_found",
            )
        tok = self.llm.tokenizer
        if tok is None:
            raise APIError("this model has no tokenizer; start the server with --tokenizer",
                           code="no_tokenizer")
        return tok

    async def tokenize(self, req: TokenizeRequest) -> dict:
        """{count, max_model_len, tokens, token_strs}, as vLLM answers."""
        tok = self._tokenizer(req)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("send exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            ids = (await self.chat._render(req))["prompt_token_ids"]
        else:
            ids = await self.chat.encode(req.prompt, "prompt",
                                         add_special_tokens=req.add_special_tokens)
        return {
            "count": len(ids),
            "max_model_len": self.llm.max_model_len,
            "tokens": ids,
            "token_strs": tok.convert_ids_to_tokens(ids) if req.return_token_strs else None,
        }

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        tok = self._tokenizer(req)
        vocab = self.llm.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"tokens: {bad[:5]} are outside the vocabulary [0, {vocab})",
                           param="tokens")
        return {"prompt": await self.llm.run_tokenizer(tok.decode, req.tokens)}

    def info(self) -> dict:
        """The tokenizer's configuration: its class, special tokens and chat template."""
        tok = self._tokenizer()
        return {
            "tokenizer_class": type(tok).__name__,
            "vocab_size": len(tok),
            "model_max_length": self.llm.max_model_len,
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "pad_token": tok.pad_token,
            "unk_token": tok.unk_token,
            "add_bos_token": getattr(tok, "add_bos_token", None),
            "chat_template": self.chat.chat_template or getattr(tok, "chat_template", None),
        }
