"""Structured outputs: a grammar per sample (llguidance), its token mask computed on the host
each step and applied to the logits on the device.

Each constrained sample holds an `LLMatcher` that consumes the sample's tokens as they are read
back. Before a step samples, the matchers of its rows fill one pinned int32 bitmask (a bit per
token), copied to the device without blocking; the sampler applies it there in one pass
(`tandem.kernels.grammar_mask`). The mask needs the previous token: with async scheduling, once
the next step's forward is launched, a worker thread has the grammars take the in-flight step's
tokens and then fills the bitmask, both in llguidance's Rust with the GIL released, while the
engine reads the in-flight step back on its own thread; the grammars' verdicts (complete, or a
token refused) are applied after. A grammar is validated once per process (`_grammar_error`),
not once a request, and compiled once per engine, its first mask computed at compile time so
every copy starts with it.
"""

from __future__ import annotations

import functools
import json
import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tandem.engine.llg_tokenizer import llguidance_tokenizer
from tandem.sampling_params import StructuredOutputsParams

_CACHE_SIZE = 64  # compiled grammars kept (an RL rollout asks for the same one many times)
# token automata kept, by their tables' bytes (host and device copies alike; one table is at most
# token_fsm.MAX_TABLE_BYTES): the samples still running keep theirs alive past eviction
_FSM_CACHE_BYTES = 256 << 20


def grammar_source(so: StructuredOutputsParams) -> str:
    """llguidance's grammar for one request's constraint."""
    from llguidance import LLMatcher

    if so.json is not None or so.json_object:
        schema = {"type": "object"} if so.json is None else so.json
        schema = schema if isinstance(schema, str) else json.dumps(schema)
        return LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": not so.disable_any_whitespace})
    if so.regex is not None:
        return LLMatcher.grammar_from_regex(so.regex)
    if so.choice is not None:
        return LLMatcher.grammar_from_regex(choice_regex(so.choice))
    return LLMatcher.grammar_from_lark(so.grammar)


def choice_regex(choices: list[str]) -> str:
    """A choice as the regex both backends compile: the alternation of the strings, escaped."""
    return "|".join(re.escape(c) for c in choices)


def check_grammar(so: StructuredOutputsParams) -> None:
    """ValueError naming the problem when the constraint does not compile (no tokenizer needed:
    the API server checks before the request reaches the engine)."""
    try:
        from llguidance import LLMatcher
    except ImportError:
        raise ValueError("structured_outputs need llguidance: pip install llguidance "
                         "(it comes with tandem[serve])") from None
    error = _grammar_error(grammar_source(so))
    if error and not error.startswith("WARNING"):
        raise ValueError(f"structured_outputs: invalid grammar: {error.strip()}")


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _grammar_error(source: str) -> str:
    """llguidance's verdict on a grammar (about a millisecond a call), once per grammar: an RL
    rollout sends the same one with every request."""
    from llguidance import LLMatcher

    return LLMatcher.validate_grammar(source)


def fsm_pattern(so: StructuredOutputsParams) -> str | None:
    """The regex a token automaton would compile for `so`: regexes, choices, and the JSON
    schemas whose documents are a regular language (`tandem.engine.json_schema_regex`); any
    JSON object and Lark grammars go to llguidance."""
    from tandem.engine.json_schema_regex import UnsupportedSchema, json_schema_regex

    if so.regex is not None:
        return so.regex
    if so.choice is not None:
        return choice_regex(so.choice)
    if so.json is not None:
        try:
            return json_schema_regex(so.json, whitespace_flexible=not so.disable_any_whitespace)
        except UnsupportedSchema:
            return None
    return None


class StructuredOutputManager:
    """Compiles constraints, cached per grammar: into token automata that step on the device
    (`tandem.engine.token_fsm`) where the backend allows and the pattern compiles, else into
    llguidance matchers."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int], backend: str = "auto"):
        try:
            import llguidance  # noqa: F401
        except ImportError:
            raise ValueError("structured_outputs need llguidance: pip install llguidance "
                             "(it comes with tandem[serve])") from None
        if tokenizer is None:
            raise ValueError("structured_outputs need a tokenizer (the grammar is over text)")
        self.tokenizer = llguidance_tokenizer(tokenizer, vocab_size, sorted(eos_token_ids))
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self.backend = backend
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._vocabulary = None  # token bytes and which may appear in text, for token automata
        self._fsms: OrderedDict[str, object] = OrderedDict()  # pattern -> TokenFSM, or the reason it has none

    def sample_grammars(self, so: StructuredOutputsParams, n: int) -> list:
        """The constraint of a request's n samples: token automata's cursors, or llguidance
        matchers. ValueError naming the problem if the grammar is invalid (or, with backend
        "fsm", cannot be a token automaton)."""
        from tandem.engine.token_fsm import FSMCursor

        if self.backend != "guidance":
            pattern = fsm_pattern(so)
            fsm = self._token_fsm(pattern) if pattern is not None else "not a regex, choice or closed JSON schema"
            if not isinstance(fsm, str):
                return [FSMCursor(fsm) for _ in range(n)]
            if self.backend == "fsm":
                raise ValueError(f"structured_outputs: structured_outputs_backend='fsm' takes regex, "
                                 f"choice and closed JSON schema constraints that compile to a token "
                                 f"automaton; {fsm}")
        return [self.matcher(so) for _ in range(n)]

    def _token_fsm(self, pattern: str):
        """The pattern's TokenFSM, or a string saying why it has none (cached either way)."""
        from tandem.engine.token_fsm import compile_token_fsm, vocabulary

        hit = self._fsms.get(pattern)
        if hit is not None:
            self._fsms.move_to_end(pattern)
            return hit
        if self._vocabulary is None:
            self._vocabulary = vocabulary(self.tokenizer, self.vocab_size)
        try:
            hit = compile_token_fsm(pattern, self._vocabulary, self.eos_token_ids)
        except (ValueError, re.error) as e:  # (UnsupportedRegex is a ValueError)
            hit = f"{type(e).__name__}: {e}"
        self._fsms[pattern] = hit
        while len(self._fsms) > 1 and (len(self._fsms) > _CACHE_SIZE or sum(
                f.next_state.nbytes for f in self._fsms.values() if not isinstance(f, str)) > _FSM_CACHE_BYTES):
            self._fsms.popitem(last=False)
        return hit

    def matcher(self, so: StructuredOutputsParams):
        """A fresh matcher for `so`; ValueError naming the problem if the grammar is invalid."""
        from llguidance import LLMatcher

        source = grammar_source(so)
        template = self._compiled.get(source)
        if template is None:
            template = LLMatcher(self.tokenizer, source, log_level=0)
            if template.is_error():
                raise ValueError(f"structured_outputs: invalid grammar: {template.get_error()}")
            _compute_first_mask(template, self.tokenizer.vocab_size)
            self._compiled[source] = template
            if len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(source)
        return template.deep_copy()



def _compute_first_mask(template, vocab_size: int) -> None:
    """Compute the grammar's mask at its start once, on the template: llguidance keeps a matcher's
    last mask for the state it was computed in, and copies inherit it, so no sample recomputes
    it. For `[a-z ]*` over SmolLM2's 49k tokens that mask took 106 ms for 256 fresh copies on
    the H200 host (the copies' computations do not run in parallel)."""
    words = (vocab_size + 31) // 32
    scratch = torch.empty(words, dtype=torch.int32)
    template.unsafe_compute_mask_ptr(scratch.data_ptr(), words * 4)


# llguidance's pool for a step's rows. On the H200 host (16 cores, a VM) a 256-row fill took
# 0.52 / 0.49 / 1.13 / 0.99 ms on 1 / 2 / 4 / its default 12 threads (~2 us of work a row: more
# threads cost more to wake than they share); here (2 cores) 0.19 / 0.16 ms on 1 / 2.
POOL_THREADS = 2


class BitmaskFiller:
    """Fills a step's bitmask on llguidance's thread pool (made at the first batch with several
    constrained rows; it belongs to the model runner, not the process), and has grammars take
    their tokens first. Both run in Rust with the GIL released, so `fill_async` lets the host's
    other work of the step go on meanwhile."""

    def __init__(self, vocab_size: int, pin: bool):
        self.words = (vocab_size + 31) // 32  # int32 words per row
        self.pin = pin
        self._executor = None
        self._thread = None  # the one thread that runs `advance_async` and `fill_async` in order
        self._accepted: list[bool] | None = None  # the last `advance`'s, until taken
        self._advancing: Future | None = None  # an `advance_async` not waited for yet

    def _pool(self):
        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor(POOL_THREADS)
        return self._executor

    def _worker(self) -> ThreadPoolExecutor:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="tandem-grammar")
        return self._thread

    def _settle(self) -> None:
        """Wait for an `advance_async` still running: its matchers are the worker's until then."""
        if self._advancing is not None:
            pending, self._advancing = self._advancing, None
            pending.result()

    def advance(self, pairs: list[tuple[object, int]]) -> list[bool]:
        """Each matcher takes its token; whether each accepted it (`take_accepted` gives it
        again). A refused token leaves its matcher in error."""
        self._settle()
        return self._advance(pairs)

    def _advance(self, pairs: list[tuple[object, int]]) -> list[bool]:
        if len(pairs) == 1:
            matcher, token = pairs[0]
            accepted = [matcher.consume_token(token)]
        else:
            accepted = self._pool().consume_token_par(pairs) if pairs else []
        self._accepted = accepted
        return accepted

    def advance_async(self, pairs: list[tuple[object, int]]) -> None:
        """`advance` on the worker thread; a later fill (`fill_async`, or on this thread) and
        `take_accepted` come after it."""
        self._settle()
        self._advancing = self._worker().submit(self._advance, pairs)

    def take_accepted(self) -> list[bool] | None:
        """The last `advance`'s verdicts, once (None if none came since the last take)."""
        self._settle()
        accepted, self._accepted = self._accepted, None
        return accepted

    def __call__(self, matchers: list) -> torch.Tensor:
        """[R, ceil(V / 32)] int32 on the host: bit t of row r set where token t may come next."""
        self._settle()
        return self._fill(matchers)

    def _fill(self, matchers: list) -> torch.Tensor:
        mask = torch.empty((len(matchers), self.words), dtype=torch.int32, pin_memory=self.pin)
        if len(matchers) == 1:
            matchers[0].unsafe_compute_mask_ptr(mask.data_ptr(), self.words * 4)
            return mask
        self._pool().unsafe_compute_mask_ptr([(m, row) for row, m in enumerate(matchers)],
                                             mask.data_ptr(), self.words * 4, len(matchers))
        return mask

    def fill_async(self, matchers: list, advance: list[tuple[object, int]] = ()) -> Future:
        """`advance`'s matchers take their tokens, then the bitmask of `matchers` is filled, on the
        worker thread (after an `advance_async` before it); `.result()` gives the bitmask."""

        def job():
            if advance:
                self._advance(advance)
            return self._fill(matchers)

        return self._worker().submit(job)
