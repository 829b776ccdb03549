"""Token automata (`tandem.engine.token_fsm`): their masks are llguidance's, token for token, on
the embedded model's real vocabulary; the vectorised token walk equals a byte-by-byte walk; the
device states step as the host's do."""

import random
import re

import numpy as np
import pytest
import torch

from tandem.engine.token_fsm import (
    FSMCursor,
    FSMStates,
    TokenVocabulary,
    compile_token_fsm,
    token_transitions,
)
from tandem.layers.sampler import GrammarFSM

llguidance = pytest.importorskip("llguidance")

PATTERNS = [
    "positive|negative|neutral",
    r"[a-z ]*",
    r"-?\d{1,3}(\.\d+)?",
    r"(yes|no), because [a-z]+\.",
    r"[A-Z][a-z]{2,8} [0-9]{4}",
    r"\w+@\w+\.(com|org)",
    "café|naïve|日本語",
    r"[^\n]{0,12}\n",
    "",
]
# closed JSON schemas (tandem.engine.json_schema_regex), compact and with flexible whitespace
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "city": {"enum": ["Paris", "Rome", "Oslo"]},
                                      "x": {"type": "number"}, "n": {"type": "null"}},
     "required": ["ok", "city"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
     "additionalProperties": False},
    {"type": "object", "properties": {
        "xs": {"type": "array", "items": {"type": "integer"}},
        "o": {"type": "object", "properties": {"k": {"const": "vé"}}, "required": ["k"], "additionalProperties": False}},
     "required": ["xs", "o"], "additionalProperties": False},
    {"type": "array", "items": {"type": "string"}},
]
GRAMMARS = [("regex", p) for p in PATTERNS] + [
    ("json", (schema, flexible)) for schema in SCHEMAS for flexible in (False, True)]


@pytest.fixture(scope="module")
def smol():
    """SmolLM2's tokenizer (the embedded model's: 49,152 tokens) as llguidance reads it."""
    from transformers import AutoTokenizer

    from tandem.engine.llg_tokenizer import llguidance_tokenizer
    from tandem.models import gguf

    try:
        path = gguf.default_gguf_path()
    except ValueError as e:
        pytest.skip(str(e))
    tok = AutoTokenizer.from_pretrained(str(gguf.converted_dir(path)))
    return tok, llguidance_tokenizer(tok, 49152, [tok.eos_token_id])


def _llg_allowed(matcher, V: int) -> np.ndarray:
    words = np.frombuffer(matcher.compute_bitmask(), dtype=np.int32)
    return np.unpackbits(words.view(np.uint8), bitorder="little")[:V].astype(bool)


def _grammars(kind, spec) -> tuple[str, str]:
    """(llguidance's grammar, the regex a token automaton compiles) for one case."""
    import json

    from llguidance import LLMatcher

    from tandem.engine.json_schema_regex import json_schema_regex

    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec), spec
    schema, flexible = spec
    return (LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": flexible}),
            json_schema_regex(schema, whitespace_flexible=flexible))


@pytest.mark.parametrize("kind,spec", GRAMMARS, ids=[f"{k}{i}" for i, (k, _) in enumerate(GRAMMARS)])
def test_masks_and_ends_are_llguidances_on_random_walks(smol, kind, spec):
    """From the start and along random token paths (text tokens mostly, EOS where allowed): the
    allowed set equals llguidance's mask in every state, and the sample ends exactly where
    llguidance's matcher stops. (Where the pattern has \\d, \\w or \\s, code points newer than this
    Python's Unicode tables are refused: see below.) One difference, by design: where the grammar forces its next
    bytes (a choice once it is unambiguous), llguidance allows only the canonical tokenization
    of them; an automaton allows every tokenization (as xgrammar, vLLM's default, does), so
    there its set holds llguidance's."""
    from llguidance import LLMatcher

    from tandem.engine.token_fsm import vocabulary

    tok, llt = smol
    V, eos = 49152, tok.eos_token_id
    grammar, pattern = _grammars(kind, spec)
    unicode_classes = re.search(r"\\[dwsDWS]", pattern) is not None
    fsm = compile_token_fsm(pattern, vocabulary(llt, V), [eos])
    rng = random.Random(0)
    forced_states = 0
    for walk in range(6):
        matcher = LLMatcher(llt, grammar, log_level=0)
        cursor = FSMCursor(fsm)
        for _ in range(32):
            allowed = fsm.next_state[cursor.state] >= 0
            want = _llg_allowed(matcher, V)
            newer = want & ~allowed
            if unicode_classes and newer.any():
                # code points that llguidance's Unicode tables class as digits or letters and
                # this Python's older ones leave unassigned (Unicode 16's outlined digits after
                # b"\xf0"): only tokens starting past ASCII, and the automaton is the stricter
                assert all(llt.decode_bytes([int(t)])[0] >= 0x80 for t in np.flatnonzero(newer))
                want &= allowed
            if matcher.compute_ff_bytes():
                forced_states += 1
                assert (allowed | ~want).all(), f"{pattern!r} walk {walk}: llguidance allows more"
            else:
                np.testing.assert_array_equal(allowed, want, err_msg=f"{pattern!r} walk {walk}")
            ids = np.flatnonzero(want)
            text = ids[ids != eos]
            token = int(rng.choice(text.tolist())) if len(text) and rng.random() > 0.15 else int(ids[0])
            assert matcher.consume_token(token)
            ended = cursor.advance(token)
            assert ended == matcher.is_stopped(), (pattern, walk, tok.decode([token]))
            if ended:
                break
    if kind == "json" or pattern.startswith("positive"):
        assert forced_states  # the case the docstring names did occur (a choice, a key)


def test_token_walk_equals_a_byte_by_byte_walk():
    """The vectorised walk against the plain one, on a random automaton and vocabulary (tokens
    of 1-7 bytes, some unusable)."""
    rng = np.random.default_rng(0)
    S = 5
    trans = rng.integers(-1, S, size=(S, 256)).astype(np.int32)
    trans[rng.random((S, 256)) < 0.5] = -1
    tokens = [bytes(rng.integers(0, 256, size=rng.integers(1, 8)).tolist()) for _ in range(300)]
    usable = rng.random(300) > 0.1
    got = token_transitions(trans, TokenVocabulary(tokens, usable))
    for s in range(S):
        for t, b in enumerate(tokens):
            state = s if usable[t] else -1
            for byte in b:
                if state < 0:
                    break
                state = int(trans[state, byte])
            assert got[s, t] == state, (s, t)


def test_eos_only_where_accepting_and_done_allows_everything():
    vocab = [b"a", b"b", b"ab", b"", b"<eos>"]
    usable = np.array([True, True, True, False, False])
    fsm = compile_token_fsm("ab?", TokenVocabulary(vocab, usable), eos_ids=[4])
    start = fsm.next_state[0]
    assert list(start >= 0) == [True, False, True, False, False]  # "a" or "ab"; no EOS yet
    c = FSMCursor(fsm)
    assert not c.advance(0)  # "a": accepting, "b" still possible
    assert list(fsm.next_state[c.state] >= 0) == [False, True, False, False, True]
    assert c.advance(1)  # "ab": complete, nothing but EOS left: ends (llguidance stops here)
    c = FSMCursor(fsm)
    assert c.tokens_kept([0, 4, 0, 0]) == (2, True)  # "a", EOS
    bitmask = fsm.allowed_bitmask()
    assert bitmask[fsm.done, 0] & 0b11111 == 0b11111  # done allows everything


def test_device_states_step_as_the_host_does():
    """GrammarFSM over two grammars in one batch (a free row between): masks from each row's
    state, states moved by the sampled tokens, as host cursors move."""
    vocab = [bytes([c]) for c in b"abc"] + [b"<eos>"]
    usable = np.array([True, True, True, False])
    v = TokenVocabulary(vocab, usable)
    fsms = [compile_token_fsm("a+b", v, [3]), compile_token_fsm("c|ab", v, [3])]
    dev = torch.device("cpu")
    store = FSMStates(dev, capacity=1)  # grows on the second bind
    cursors = [FSMCursor(fsms[0]), FSMCursor(fsms[1])]
    store.bind(cursors)
    assert store.num_bound == 2
    tables = [f.device_tables(dev) for f in fsms]
    g = GrammarFSM(rows=torch.tensor([0, 2]), slots=torch.tensor([c.slot for c in cursors]),
                   offsets=torch.tensor([0, fsms[0].num_states], dtype=torch.int32),
                   allowed=torch.cat([t[0] for t in tables]),
                   next_state=torch.cat([t[1] for t in tables]), states=store)
    for tokens in ([0, 1, 0], [0, 1, 1]):  # row 1 is free
        logits = torch.zeros(3, 4)
        g.apply(logits)
        for row, c in ((0, cursors[0]), (2, cursors[1])):
            want = torch.from_numpy(c.fsm.next_state[c.state] >= 0)
            assert torch.equal(logits[row] == 0, want), (row, c.state)
        assert (logits[1] == 0).all()
        g.advance(torch.tensor(tokens))
        for row, c in ((0, cursors[0]), (2, cursors[1])):
            c.advance(tokens[row])
        assert store.tensor[g.slots].tolist() == [c.state for c in cursors]
    for c in cursors:
        c.release()
    assert store.num_bound == 0


def test_compiled_automata_are_kept_by_bytes(monkeypatch):
    """The manager keeps compiled automata up to a byte budget, most recently used last; a
    pattern the byte compiler lacks is cached as the reason (and goes to llguidance)."""
    from model_fixtures import make_tokenizer

    from tandem.engine import structured_output
    from tandem.engine.structured_output import StructuredOutputManager
    from tandem.sampling_params import StructuredOutputsParams

    tok = make_tokenizer()
    manager = StructuredOutputManager(tok, 320, frozenset([tok.eos_token_id]))
    first = manager.sample_grammars(StructuredOutputsParams(regex="[a-z]+"), 1)[0]
    assert isinstance(first, FSMCursor)
    monkeypatch.setattr(structured_output, "_FSM_CACHE_BYTES", first.fsm.next_state.nbytes)
    second = manager.sample_grammars(StructuredOutputsParams(regex="[0-9]+"), 1)[0]
    assert list(manager._fsms) == ["[0-9]+"]  # the first went over the budget
    assert first.fsm.num_states and second.fsm is manager._fsms["[0-9]+"]
    flagged = manager.sample_grammars(StructuredOutputsParams(regex="(?i)cat"), 1)[0]  # (Rust's syntax)
    assert not isinstance(flagged, FSMCursor)  # an llguidance matcher
    assert isinstance(manager._fsms["(?i)cat"], str)
