"""compile_regex against an independent oracle, Python's `re.fullmatch` (with Rust's \\s and \\w,
written here from the spec, where the two differ); UTF-8 validity; structure (trim, minimal,
deterministic breadth-first numbering); refusals, and refusing fast."""

from __future__ import annotations

import functools
import re
import time
import unicodedata
from collections import deque

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.engine.regex_dfa import ByteDFA, UnsupportedRegex, compile_regex

PROPERTY = settings(max_examples=40, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Rust regex's \s: the White_Space property, listed by hand
RUST_SPACE = set("\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000") | {
    chr(c) for c in range(0x2000, 0x200B)}
# Rust regex's \w, code point by code point: Alphabetic (L*, Nl, the So letters of
# Other_Alphabetic: circled and squared Latin) + M + Nd + Pc + Join_Control
_OTHER_ALPHABETIC_SO = [(0x24B6, 0x24E9), (0x1F130, 0x1F149), (0x1F150, 0x1F169),
                        (0x1F170, 0x1F189)]


def rust_word(ch: str) -> bool:
    cat, cp = unicodedata.category(ch), ord(ch)
    return (cat[0] in "LM" or cat in ("Nl", "Nd", "Pc") or ch in "\u200c\u200d"
            or any(lo <= cp <= hi for lo, hi in _OTHER_ALPHABETIC_SO))


def _code_points():
    return (c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF)


@functools.lru_cache(maxsize=1)
def rust_word_set() -> frozenset[int]:
    return frozenset(c for c in _code_points() if rust_word(chr(c)))


@functools.lru_cache(maxsize=1)
def word_class_body() -> str:
    """The inside of a Python `[...]` holding exactly the Rust \\w code points."""
    runs: list[list[int]] = []
    for c in sorted(rust_word_set()):
        if runs and runs[-1][1] == c - 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return "".join(f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in runs)


def rust_oracle(oracle: str) -> re.Pattern:
    """`<w>`/`<s>` stand for the bodies of Rust's \\w/\\s classes."""
    space = "".join(f"\\U{ord(c):08x}" for c in sorted(RUST_SPACE))
    if "<w>" in oracle:
        oracle = oracle.replace("<w>", word_class_body())
    return re.compile(oracle.replace("<s>", space))


# (pattern, oracle for re.fullmatch; None: the pattern itself)
PATTERNS = [
    ("abc", None),
    ("a|ab|abc", None),  # alternatives sharing prefixes
    ("(a|)b", None),  # an empty alternative
    ("(?:ab|ac)*d", None),
    ("a*", None),
    ("a+?b", None),  # lazy: the same language under full match
    ("(?:xy)??z", None),
    ("a{3}", None),
    ("a{2,}", None),
    ("(?:ab){1,3}c{0,2}", None),
    ("((a|b)(c|d)?)+e", None),  # nested groups
    (".", None),
    (".{0,5}", None),
    (".*x.*", None),
    ("[a-f0-9]+", None),
    ("[^abc]*", None),
    ('[^"\\\\]*', None),
    ("é+ü?", None),
    ("[à-ÿ😀-🙏]{1,3}", None),
    ("[^é😀]+", None),
    ("\\u00e9\\x41\\t\\.\\n", None),
    ("(?P<year>\\d{4})-(?P<month>\\d\\d)", None),  # \d is category Nd in both
    ("\\D+", None),
    ("^(?:[a-z]+ )*[a-z]+$", None),
    ("\\A(?:true|false|null)\\Z", None),
    ('\\{"name": "[a-z]{1,10}", "age": \\d{1,3}\\}', None),
    ("(?:\\+|-)?\\d+(?:\\.\\d+)?(?:[eE][+-]?\\d+)?", None),
    ("\\s*,\\s*", "[<s>]*,[<s>]*"),
    ("\\S+", "[^<s>]+"),
    ("[\\s\\d]+", "[<s>\\d]+"),
    ("\\w+", "[<w>]+"),
    ("\\W*", "[^<w>]*"),
    ("[\\w.-]+@\\w+\\.\\w{2,3}", "[<w>.-]+@[<w>]+\\.[<w>]{2,3}"),
    ("[^\\W\\d]+", "(?:(?!\\d)[<w>])+"),
]
IDS = [p for p, _ in PATTERNS]
# characters where Python's re and Rust's regex disagree, or that UTF-8 makes interesting
SPECIAL = list("\x1c\x1f\x85\xa0\u2028\u00b2\u0300\u24b6\u203f\u200c\u0663éü😀\U0001f130_ \n")


@functools.cache
def dfa_for(pattern: str) -> ByteDFA:
    return compile_regex(pattern)


def _check(pattern: str, oracle: str | None, s: str) -> None:
    expected = (rust_oracle(oracle) if oracle else re.compile(pattern)).fullmatch(s) is not None
    assert dfa_for(pattern).matches(s.encode()) == expected, (pattern, s)


@pytest.mark.parametrize("pattern,oracle", PATTERNS, ids=IDS)
@PROPERTY
@given(data=st.data())
def test_random_text_agrees_with_re(pattern, oracle, data):
    alphabet = st.sampled_from(sorted(set(pattern)) + SPECIAL) | st.characters(codec="utf-8")
    _check(pattern, oracle, data.draw(st.text(alphabet, max_size=12)))


@pytest.mark.parametrize("pattern,oracle", PATTERNS, ids=IDS)
@PROPERTY
@given(data=st.data())
def test_matching_text_agrees_with_re(pattern, oracle, data):
    # drawn to match Python's reading; the Rust oracle judges where \s or \w differ
    _check(pattern, oracle, data.draw(st.from_regex(pattern, fullmatch=True)))


@pytest.mark.parametrize("ch,space,word", [
    ("\x1c", False, False),  # Python: \s; Rust: not White_Space
    ("\x85", True, False),
    ("\u00b2", False, False),  # No: Python \w (isnumeric), not Rust
    ("\u0300", False, True),  # Mn: Rust \w, not Python
    ("\u24b6", False, True),  # So but Other_Alphabetic
    ("\u203f", False, True),  # Pc
    ("\u200c", False, True),  # Join_Control
    ("\u0663", False, True),  # Nd
])
def test_perl_classes_follow_rust(ch, space, word):
    assert compile_regex(r"\s").matches(ch.encode()) == space
    assert compile_regex(r"\S").matches(ch.encode()) == (not space)
    assert compile_regex(r"\w").matches(ch.encode()) == word
    assert compile_regex(r"\W").matches(ch.encode()) == (not word)


# -- whole classes, every code point --------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _all_code_points():
    cps = np.fromiter(_code_points(), dtype=np.int64)
    encoded = [chr(c).encode() for c in cps.tolist()]
    lengths = np.array([len(e) for e in encoded])
    data = np.frombuffer(b"".join(e.ljust(4, b"\0") for e in encoded), np.uint8).reshape(-1, 4)
    return cps, data, lengths


def accepted_code_points(dfa: ByteDFA) -> set[int]:
    """Walk every code point's UTF-8 through the DFA at once."""
    cps, data, lengths = _all_code_points()
    table = np.vstack([dfa.transitions, np.full((1, 256), -1)])  # last row: dead
    dead, state = len(table) - 1, np.zeros(len(cps), dtype=np.int64)
    for k in range(4):
        live = lengths > k
        nxt = table[state[live], data[live, k]]
        state[live] = np.where(nxt < 0, dead, nxt)
    return set(cps[np.append(dfa.accepting, False)[state]].tolist())


def _python_class(pattern: str) -> set[int]:
    text = "".join(map(chr, _code_points()))
    return {ord(c) for c in re.findall(pattern, text)}


@pytest.mark.parametrize("pattern", [".", "[^a]", "[^\\n]", "[a-zé-ü]", "[^😀-🙏x]", "\\d", "\\D",
                                     "[\\ud000-\\ue100]", "[\\x00-\\U0010ffff]"])
def test_class_code_points_match_python(pattern):
    assert accepted_code_points(compile_regex(pattern)) == _python_class(pattern)


def test_perl_class_code_points_match_rust_definitions():
    space = {ord(c) for c in RUST_SPACE}
    word = rust_word_set()
    everything = set(_code_points())
    assert accepted_code_points(compile_regex(r"\s")) == space
    assert accepted_code_points(compile_regex(r"\S")) == everything - space
    assert accepted_code_points(compile_regex(r"\w")) == word
    assert accepted_code_points(compile_regex(r"\W")) == everything - word
    assert accepted_code_points(compile_regex(r"[^\W\d]")) == word - _python_class(r"\d")


def test_dot_is_nine_states():
    # start, done, 1/2/3 continuation bytes to go, and the lead bytes that narrow the next byte:
    # E0 (A0..BF, no overlong), ED (80..9F, no surrogate), F0 (90..BF), F4 (80..8F, <= 10FFFF)
    assert compile_regex(".").num_states == 9


# -- UTF-8 validity -------------------------------------------------------------------------------

ANY_TEXT = "(?:.|\\n)*"  # accepts exactly the valid UTF-8
INVALID = [b"\x80", b"\xbf", b"\xc0\x80", b"\xc1\xbf", b"\xe0\x80\x80", b"\xed\xa0\x80",
           b"\xed\xbf\xbf", b"\xf0\x80\x80\x80", b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80",
           b"\xff", b"\xc3\x28", b"\xe2\x82\x28"]
UTF8_PATTERNS = [ANY_TEXT, ".*", "[^a]*", "\\W*", "\\S+", "[^é😀]+"]


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


@st.composite
def near_utf8(draw):
    """Valid UTF-8 with one byte replaced: invalid close to the edge."""
    data = bytearray(draw(st.text(min_size=1, max_size=6)).encode())
    data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0x80, 0xFF))
    return bytes(data)


@PROPERTY
@given(st.binary(max_size=12) | near_utf8())
def test_invalid_utf8_never_accepted(data):
    valid = _is_utf8(data)
    assert dfa_for(ANY_TEXT).matches(data) == valid
    if not valid:
        for pattern in UTF8_PATTERNS:
            assert not dfa_for(pattern).matches(data), pattern


def _bfs_prefixes(dfa: ByteDFA) -> dict[int, bytes]:
    prefix, queue = {0: b""}, deque([0])
    while queue:
        s = queue.popleft()
        for b, t in enumerate(dfa.transitions[s].tolist()):
            if t >= 0 and t not in prefix:
                prefix[t] = prefix[s] + bytes([b])
                queue.append(t)
    return prefix


@pytest.mark.parametrize("pattern", UTF8_PATTERNS)
def test_invalid_utf8_dies_within_the_sequence(pattern):
    dfa = dfa_for(pattern)
    for s, prefix in _bfs_prefixes(dfa).items():
        if not _is_utf8(prefix):
            continue  # mid-character: a continuation byte is fine there
        for bad in INVALID:
            state = s
            for b in bad:
                state = int(dfa.transitions[state, b])
                if state < 0:
                    break
            assert state < 0, (pattern, prefix, bad)


# -- structure ------------------------------------------------------------------------------------

SMALL = ["", "a", "a*", "(a|b)*a(a|b){3}", "(ab|a)(c|bcd)", "a+|a*b", "(?:a|ab)*c", "x{2,5}",
         ".{0,3}", "[^a]?b", "(?:é|e)+", "\\s*", "(a|)", "(?:ab|ac)*d|abd", '\\{"k": \\d{1,2}\\}']


def _moore_blocks(dfa: ByteDFA) -> int:
    """Equivalence classes of states (plus an explicit dead state) by plain refinement."""
    rows = dfa.transitions.tolist()
    n = len(rows)
    block = [int(a) for a in dfa.accepting.tolist()] + [2]  # dead state n: its own block
    while True:
        sig = [(block[s], tuple(block[t if t >= 0 else n] for t in rows[s])) for s in range(n)]
        sig.append((block[n], ("dead",)))
        ids: dict = {}
        new = [ids.setdefault(x, len(ids)) for x in sig]
        if len(ids) == len(set(block)):
            return len(ids) - 1  # minus the dead block
        block = new


@pytest.mark.parametrize("pattern", SMALL + ["\\w", "[\\w.-]+@\\w+"])
def test_structure(pattern):
    dfa = compile_regex(pattern)
    n = dfa.num_states
    assert dfa.transitions.shape == (n, 256) and dfa.transitions.dtype == np.int32
    assert dfa.accepting.shape == (n,) and dfa.accepting.dtype == np.bool_
    # numbered breadth-first from 0 over bytes 0..255: states appear in order
    assert list(_bfs_prefixes(dfa)) == list(range(n))
    # co-reachable: some path from every state accepts
    live = set(np.flatnonzero(dfa.accepting).tolist())
    grew = True
    while grew:
        grew = False
        for s, row in enumerate(dfa.transitions.tolist()):
            if s not in live and any(t in live for t in row if t >= 0):
                live.add(s)
                grew = True
    assert live == set(range(n))
    assert _moore_blocks(dfa) == n  # minimal: no two states equivalent
    again = compile_regex(pattern)
    assert np.array_equal(again.transitions, dfa.transitions)
    assert np.array_equal(again.accepting, dfa.accepting)


def test_state_counts_by_hand():
    assert compile_regex("a").num_states == 2
    assert compile_regex("a{3}").num_states == 4
    assert compile_regex("(a|b)*a(a|b){3}").num_states == 16  # 4th from last is a: 2**4
    assert compile_regex("(a|b)*a(a|b){3}", max_states=16).num_states == 16
    with pytest.raises(UnsupportedRegex):
        compile_regex("(a|b)*a(a|b){3}", max_states=15)


@pytest.mark.parametrize("pattern", ["", "a*", "(a|)", "^$", "\\A\\Z", "(?:)", "x?y?"])
def test_empty_string(pattern):
    dfa = compile_regex(pattern)
    assert dfa.accepting[0] and dfa.matches(b"")
    if pattern in ("", "^$", "\\A\\Z", "(?:)"):
        assert dfa.num_states == 1 and (dfa.transitions == -1).all()


def test_anchors_at_the_ends_are_no_ops():
    plain = compile_regex("a|bc")
    for anchored in ["^a|bc$", "\\A(?:a|bc)\\Z", "(?:^a|^bc)", "^(a|bc)$", "^^a$$|bc"]:
        dfa = compile_regex(anchored)
        assert np.array_equal(dfa.transitions, plain.transitions), anchored
        assert np.array_equal(dfa.accepting, plain.accepting), anchored


# -- refusals -------------------------------------------------------------------------------------

@pytest.mark.parametrize("pattern,what", [
    ("(?=a)a", "lookahead"), ("(?!a)b", "lookahead"), ("(?<=a)b", "lookbehind"),
    ("(?<!a)b", "lookbehind"), ("(a)\\1", "backreference"), ("(?P<x>a)(?P=x)", "backreference"),
    ("(a)?(?(1)b|c)", "conditional"), ("a\\b", "\\b"), ("a\\Bb", "\\B"),
    ("(?i)a", "inline flags"), ("(?i:a)b", "inline flags"), ("(?x)a b", "inline flags"),
    ("(?s).", "inline flags"), ("(?m)^a$", "inline flags"), ("(?a)\\w", "inline flags"),
    ("a*+", "possessive"), ("a++", "possessive"), ("(?>a)", "atomic"),
    ("a^", "^"), ("a$b", "$"), ("(^a)*", "^"), ("a\\Ab", "\\A"),
    ("[[:alpha:]]", "character class"), ("[a-z&&[^aeiou]]", "character class"),
    ("[a~~b]", "character class"), ("[a[b]]", "character class"),
    ("\\p{L}", "parse"), ("a{2,1}", "parse"), ("(", "parse"),
    ("[^\\x00-\\U0010ffff]", "matches nothing"), ("a[^\\x00-\\U0010ffff]", "matches nothing"),
    ("\\ud800", "matches nothing"),
])
def test_unsupported(pattern, what):
    with pytest.raises(UnsupportedRegex, match=re.escape(what)):
        compile_regex(pattern)


@pytest.mark.parametrize("pattern,max_states", [
    ("(a|b)*a(a|b){20}", 1000), ("a{5000}", 4096), ("a{0,5000}", 4096), ("(a?){5000}", 4096),
    ("(?:a{1000}){1000}", 4096), ("\\w{50}", 4096), (".{1000}", 4096),
])
def test_too_many_states_fails_fast(pattern, max_states):
    start = time.perf_counter()
    with pytest.raises(UnsupportedRegex):
        compile_regex(pattern, max_states=max_states)
    assert time.perf_counter() - start < 2.0


def test_unsupported_is_a_value_error():
    assert issubclass(UnsupportedRegex, ValueError)
    with pytest.raises(ValueError, match="max_states"):
        compile_regex("a", max_states=0)


# -- llguidance, byte by byte ---------------------------------------------------------------------

def _byte_matcher_factory():
    llg = pytest.importorskip("llguidance")

    class ByteTokenizer:  # one token per byte, then EOS: masks over bytes
        eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
        tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]

        def __call__(self, s):
            return list(s.encode() if isinstance(s, str) else s)

    tok = llg.LLTokenizer(llg.TokenizerWrapper(ByteTokenizer()), slices=[])
    return lambda p: llg.LLMatcher(tok, llg.LLMatcher.grammar_from_regex(p))


@pytest.mark.parametrize("pattern", [".", ".{0,3}x", "\\s+", "\\S", '[^"\\\\]*', "(ab|a)(c|bcd)",
                                     '\\{"name": "[a-z]{1,10}", "age": [0-9]{1,3}\\}', "^a+$"])
def test_same_masks_as_llguidance(pattern):
    """At one prefix per state, llguidance allows exactly the bytes with a transition, and EOS
    exactly in accepting states. (\\w and \\d are left out: llguidance's Unicode tables are newer
    than this Python's unicodedata, so some rows differ by code points Python calls unassigned.)"""
    make = _byte_matcher_factory()
    dfa = compile_regex(pattern)
    for s, prefix in _bfs_prefixes(dfa).items():
        m = make(pattern)
        assert m.consume_tokens(list(prefix)), (pattern, prefix)
        words = np.frombuffer(m.compute_bitmask(), dtype=np.uint32)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:257].astype(bool)
        assert np.array_equal(bits[:256], dfa.transitions[s] >= 0), (pattern, prefix)
        assert bits[256] == dfa.accepting[s], (pattern, prefix)
