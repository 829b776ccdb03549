"""Incremental detokenization: text deltas that never split a multi-byte character."""

from __future__ import annotations

_CONTEXT_TOKENS = 6  # prompt tokens decoded alongside, so the first word keeps its leading space


def rust_backend(tokenizer):
    """A fast tokenizer's Rust backend where it decodes the same text as the tokenizer (no cleanup
    pass configured), else None: it skips transformers' per-call Python (argument normalisation,
    a walk over every id, cleanup checks)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False) else None


def batch_decode(tokenizer, sequences: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
    """`tokenizer.batch_decode`, through the Rust backend's batch call where it gives the same
    texts (`rust_backend`): the sequences decoded in parallel threads, outside the GIL."""
    backend = rust_backend(tokenizer)
    if backend is None:
        return tokenizer.batch_decode(sequences, skip_special_tokens=skip_special_tokens)
    return backend.decode_batch(sequences, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # this runs twice per generated token: the Rust backend where it decodes the same text
        backend = rust_backend(tokenizer)
        self._backend_decode = backend.decode if backend is not None else None
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.num_context = len(self.ids)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    @property
    def num_added(self) -> int:
        """Output tokens taken so far."""
        return len(self.ids) - self.num_context

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (may be empty)."""
        return self.add_many((token_id,))

    def add_many(self, token_ids) -> str:
        """Append tokens; return the text they complete (may be empty). One pair of decodes for
        all of them: a streamed request is detokenized when it emits, not at every token."""
        if not token_ids:
            return ""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of a sequence: emit what was held back waiting for more bytes."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta


class DeltaText:
    """The text of one request's streamed deltas, made where they are read (the API process, as
    vLLM V1's frontend does) from their token ids: an IncrementalDetokenizer a sample, started
    with its first delta (the prompt's last tokens give the context). Fed the same token chunks
    as the engine's own detokenizer would be (a delta's tokens are those since the last one), it
    gives the same text."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.samples: dict[int, IncrementalDetokenizer] = {}

    def fill(self, out) -> None:
        """Set the text of each completion of `out` (a delta RequestOutput, text left empty)."""
        for c in out.outputs:
            det = self.samples.get(c.index)
            if det is None:
                det = self.samples[c.index] = IncrementalDetokenizer(
                    self.tokenizer, out.prompt_token_ids, self.skip_special_tokens)
            c.text = det.add_many(c.token_ids) + (det.flush() if c.finish_reason is not None else "")
