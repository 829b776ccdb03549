"""Regex -> minimal byte-level DFA, the automaton a device-side structured-output mask walks.

Python's parser (`re._parser`) reads the pattern; a Thompson NFA over byte ranges (classes split
into UTF-8 byte-range sequences, as Rust regex-syntax's `Utf8Sequences`) is determinized over byte
equivalence classes, minimized (Hopcroft) and numbered breadth-first from state 0 over bytes
0..255, so one pattern always gives identical arrays.

Full match, as llguidance's `grammar_from_regex` and vLLM's `structured_outputs.regex` read a
pattern: `compile_regex(p).matches(s.encode())` is `re.fullmatch(p, s) is not None`, except that
the Perl classes follow Rust's `regex` (llguidance is Rust), not Python's `re`:
  \\d  general category Nd (as Python)
  \\s  the White_Space property (Python adds U+001C..U+001F)
  \\w  Alphabetic + M + Nd + Pc + Join_Control, Alphabetic as L* + Nl + the So letters of
      Other_Alphabetic (circled and squared Latin); Python uses isalnum() + "_"
taken from this Python's `unicodedata`, whose Unicode version may lag Rust's. Surrogates are in no
class (`.` and negations included): only valid UTF-8 is accepted, and a byte that cannot continue
valid UTF-8 has no transition. Lookaround, backreferences, `\\b`, inline flags, possessive repeats,
atomic groups, anchors away from the ends and set syntax Rust reads differently raise
`UnsupportedRegex`: the caller falls back to llguidance.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections import deque
from dataclasses import dataclass

import numpy as np

try:
    from re import _constants as _c
    from re import _parser
except ImportError:  # Python < 3.11
    import sre_constants as _c  # type: ignore[no-redef]
    import sre_parse as _parser  # type: ignore[no-redef]

_MAX_CP = 0x10FFFF
_WHITE_SPACE = ((0x09, 0x0D), (0x20, 0x20), (0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680),
                (0x2000, 0x200A), (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F),
                (0x3000, 0x3000))
# Alphabetic code points outside L*, Nl and M (PropList.txt's Other_Alphabetic of category So)
_OTHER_ALPHABETIC_SO = ((0x24B6, 0x24E9), (0x1F130, 0x1F149), (0x1F150, 0x1F169),
                        (0x1F170, 0x1F189))
_JOIN_CONTROL = ((0x200C, 0x200D),)
_WORD_CATEGORIES = ["Lu", "Ll", "Lt", "Lm", "Lo", "Nl", "Mn", "Mc", "Me", "Nd", "Pc"]
_RAW_STATES_PER_STATE = 2  # subset construction may pass max_states by this before minimizing
_WORK_PER_STATE = 64  # NFA size and subset-construction work allowed per max_states

_UNSUPPORTED_OPS = {
    _c.ASSERT: "lookahead/lookbehind", _c.ASSERT_NOT: "negative lookahead/lookbehind",
    _c.GROUPREF: "backreference", _c.GROUPREF_EXISTS: "conditional group (?(id)yes|no)",
    getattr(_c, "POSSESSIVE_REPEAT", None): "possessive repeat",  # both new in Python 3.11
    getattr(_c, "ATOMIC_GROUP", None): "atomic group",
}
_ANCHOR_NAMES = {_c.AT_BOUNDARY: r"\b", _c.AT_NON_BOUNDARY: r"\B", _c.AT_BEGINNING: "^",
                 _c.AT_BEGINNING_STRING: r"\A", _c.AT_END: "$", _c.AT_END_STRING: r"\Z"}


class UnsupportedRegex(ValueError):
    """The pattern uses something this compiler does not handle (the caller falls back to
    llguidance)."""


@dataclass(frozen=True, eq=False)  # eq=False: numpy arrays have no truth value to compare by
class ByteDFA:
    """A minimal DFA over UTF-8 bytes; start state 0, -1 where no match is possible any more."""

    transitions: np.ndarray  # [S, 256] int32
    accepting: np.ndarray  # [S] bool

    @property
    def num_states(self) -> int:
        return int(self.transitions.shape[0])

    def matches(self, data: bytes) -> bool:
        """Whether the whole of `data` is in the language."""
        state = 0
        for byte in data:
            state = int(self.transitions[state, byte])
            if state < 0:
                return False
        return bool(self.accepting[state])


def compile_regex(pattern: str, max_states: int = 4096) -> ByteDFA:
    """The minimal byte DFA that accepts the UTF-8 encodings of the strings `pattern` fully
    matches. UnsupportedRegex (a ValueError) for constructs outside the module docstring's list,
    for patterns Python's `re` cannot parse (Rust syntax such as `\\p{L}` is llguidance's to judge),
    for an empty language, and past `max_states` states."""
    if max_states < 1:
        raise ValueError(f"max_states ({max_states}) must be >= 1")
    _check_set_syntax(pattern)  # before Python's parser warns about the same syntax
    try:
        parsed = _parser.parse(pattern, 0)
    except re.error as e:
        raise UnsupportedRegex(f"Python's re cannot parse {pattern!r}: {e}") from e
    flags = getattr(parsed, "state", None) or parsed.pattern
    if flags.flags & ~_c.SRE_FLAG_UNICODE:
        raise UnsupportedRegex(f"{pattern!r}: inline flags")
    budget = _WORK_PER_STATE * max_states
    nfa = _NFA(budget)
    accept = _emit(nfa, list(parsed), 0, first=True, last=True)
    table, accepting, byte_class = _determinize(nfa, accept, max_states, budget)
    table, accepting, start = _minimize(table, accepting)
    if len(table) > max_states:
        raise UnsupportedRegex(f"{pattern!r} needs {len(table)} DFA states > {max_states}")
    table, accepting = _bfs_renumber(table, accepting, start)
    transitions = np.ascontiguousarray(table[:, byte_class], dtype=np.int32)  # [S, 256]
    return ByteDFA(transitions, accepting)


# -- code point sets: sorted tuples of disjoint, non-adjacent (lo, hi), surrogates removed --------

def _merge(ranges) -> list[tuple[int, int]]:
    """Sorted, with overlapping and adjacent ranges joined."""
    merged: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def _normalize(ranges) -> tuple[tuple[int, int], ...]:
    out = []
    for lo, hi in _merge(ranges):  # cut the surrogate gap, which UTF-8 cannot encode
        if lo < 0xD800:
            out.append((lo, min(hi, 0xD7FF)))
        if hi > 0xDFFF:
            out.append((max(lo, 0xE000), hi))
    return tuple(out)


def _negate(ranges: tuple) -> tuple[tuple[int, int], ...]:
    out, nxt = [], 0
    for lo, hi in ranges:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= _MAX_CP:
        out.append((nxt, _MAX_CP))
    return _normalize(out)


def _mask_ranges(mask: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[0::2].tolist(), (edges[1::2] - 1).tolist()))


@functools.lru_cache(maxsize=1)
def _perl_classes() -> dict[str, tuple]:
    """\\d, \\s, \\w as Rust's regex defines them (module docstring), computed once."""
    cats = np.array([unicodedata.category(chr(cp)) for cp in range(_MAX_CP + 1)])
    word = _mask_ranges(np.isin(cats, _WORD_CATEGORIES))
    return {"d": _normalize(_mask_ranges(cats == "Nd")), "s": _normalize(_WHITE_SPACE),
            "w": _normalize(word + list(_OTHER_ALPHABETIC_SO) + list(_JOIN_CONTROL))}


_CATEGORIES = {_c.CATEGORY_DIGIT: ("d", False), _c.CATEGORY_NOT_DIGIT: ("d", True),
               _c.CATEGORY_SPACE: ("s", False), _c.CATEGORY_NOT_SPACE: ("s", True),
               _c.CATEGORY_WORD: ("w", False), _c.CATEGORY_NOT_WORD: ("w", True)}


def _class_ranges(items) -> tuple:
    """The code points of a parsed `[...]`."""
    negate, ranges = False, []
    for op, av in items:
        if op is _c.NEGATE:
            negate = True
        elif op is _c.LITERAL:
            ranges.append((av, av))
        elif op is _c.RANGE:
            ranges.append(av)
        elif op is _c.CATEGORY and av in _CATEGORIES:
            name, negated = _CATEGORIES[av]
            cls = _perl_classes()[name]
            ranges.extend(_negate(cls) if negated else cls)
        else:
            raise UnsupportedRegex(f"{op} {av} in a character class")
    ranges = _normalize(ranges)
    return _negate(ranges) if negate else ranges


def _utf8_sequences(ranges: tuple) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Byte-range sequences whose byte strings are exactly the UTF-8 encodings of `ranges`
    (regex-syntax's `Utf8Sequences`): split at the encoding-length boundaries, then until every
    continuation byte spans its whole 0x80..0xBF or the lead byte is fixed."""
    out = []
    for lo, hi in ranges:
        stack = [(lo, hi)]
        while stack:
            lo, hi = stack.pop()
            for bound in (0x7F, 0x7FF, 0xFFFF):
                if lo <= bound < hi:
                    stack.append((bound + 1, hi))
                    hi = bound
            if hi <= 0x7F:
                out.append(((lo, hi),))
                continue
            for i in (1, 2, 3):
                m = (1 << (6 * i)) - 1
                if lo & ~m != hi & ~m:
                    if lo & m:
                        stack += [((lo | m) + 1, hi), (lo, lo | m)]
                        break
                    if hi & m != m:
                        stack += [(hi & ~m, hi), (lo, (hi & ~m) - 1)]
                        break
            else:
                out.append(tuple(zip(chr(lo).encode(), chr(hi).encode())))
    return tuple(out)


# -- Thompson NFA over byte ranges -----------------------------------------------------------------

class _NFA:
    """States 0..n-1; `eps[s]` epsilon targets, `edges[s]` (lo, hi, target) byte ranges."""

    def __init__(self, budget: int):
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[int, int, int]]] = []
        self.size, self.budget = 0, budget
        self.state()

    def _grow(self, n: int) -> None:
        self.size += n
        if self.size > self.budget:  # `a{100000}` and friends stop here, not after minutes
            raise UnsupportedRegex(f"pattern too large (NFA over {self.budget} states + edges)")

    def state(self) -> int:
        self._grow(1)
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def char_class(self, start: int, ranges: tuple) -> int:
        """One code point of `ranges`, read from `start`: a copy of the class's template."""
        n, edges = _class_template(ranges)
        self._grow(n - 1 + len(edges))
        base = len(self.eps) - 1  # template state k > 0 becomes base + k
        self.eps.extend([] for _ in range(n - 1))
        self.edges.extend([] for _ in range(n - 1))
        for src, lo, hi, dst in edges:
            self.edges[base + src if src else start].append((lo, hi, base + dst))
        return base + 1


@functools.lru_cache(maxsize=256)
def _class_template(ranges: tuple) -> tuple[int, list[tuple[int, int, int, int]]]:
    """(states, edges (src, lo, hi, dst)) reading one code point of `ranges` from state 0 to 1.
    Sequences share their suffixes, which keeps `\\w` at a few thousand edges."""
    suffix_state, edges, n = {(): 1}, [], 2
    first: dict[int, list[tuple[int, int]]] = {}
    for seq in _utf8_sequences(ranges):
        for i in range(len(seq) - 1, 0, -1):
            if seq[i:] not in suffix_state:
                edges.append((n, *seq[i], suffix_state[seq[i + 1:]]))
                suffix_state[seq[i:]], n = n, n + 1
        first.setdefault(suffix_state[seq[1:]], []).append(seq[0])
    for dst, byte_ranges in first.items():
        edges += [(0, lo, hi, dst) for lo, hi in _merge(byte_ranges)]
    return n, edges


def _emit(nfa: _NFA, items: list, start: int, first: bool, last: bool) -> int:
    """Compile a parsed sequence from `start`; returns its end state. `first`/`last`: the sequence
    begins/ends the whole pattern, where `^`/`$` are no-ops under full match."""
    solid = [k for k, (op, _) in enumerate(items) if op is not _c.AT]
    lo_k, hi_k = (solid[0], solid[-1]) if solid else (len(items), -1)
    for k, (op, av) in enumerate(items):
        start = _emit_item(nfa, op, av, start, first and k <= lo_k, last and k >= hi_k)
    return start


def _emit_item(nfa: _NFA, op, av, start: int, first: bool, last: bool) -> int:
    if op is _c.LITERAL:
        return nfa.char_class(start, _normalize([(av, av)]))
    if op is _c.NOT_LITERAL:
        return nfa.char_class(start, _negate(_normalize([(av, av)])))
    if op is _c.ANY:
        return nfa.char_class(start, _negate(((0x0A, 0x0A),)))
    if op is _c.IN:
        return nfa.char_class(start, _class_ranges(av))
    if op is _c.SUBPATTERN:
        _, add_flags, del_flags, sub = av
        if add_flags or del_flags:
            raise UnsupportedRegex("inline flags in a group")
        return _emit(nfa, list(sub), start, first, last)
    if op is _c.BRANCH:
        end = nfa.state()
        for alt in av[1]:
            s = nfa.state()
            nfa.eps[start].append(s)
            nfa.eps[_emit(nfa, list(alt), s, first, last)].append(end)
        return end
    if op is _c.MAX_REPEAT or op is _c.MIN_REPEAT:  # lazy or greedy: one language under fullmatch
        return _emit_repeat(nfa, *av, start)
    if op is _c.AT:
        if (av in (_c.AT_BEGINNING, _c.AT_BEGINNING_STRING) and first) or (
                av in (_c.AT_END, _c.AT_END_STRING) and last):
            return start
        where = "" if av in (_c.AT_BOUNDARY, _c.AT_NON_BOUNDARY) else " away from the pattern's ends"
        raise UnsupportedRegex(f"anchor {_ANCHOR_NAMES.get(av, av)}{where}")
    raise UnsupportedRegex(_UNSUPPORTED_OPS.get(op, str(op)))


def _emit_repeat(nfa: _NFA, lo: int, hi: int, sub, start: int) -> int:
    items = list(sub)
    for _ in range(lo):
        start = _emit(nfa, items, start, False, False)
    end = nfa.state()
    if hi == _c.MAXREPEAT:
        loop = nfa.state()
        nfa.eps[start].append(loop)
        nfa.eps[_emit(nfa, items, loop, False, False)].append(loop)
        nfa.eps[loop].append(end)
        return end
    for _ in range(hi - lo):  # each optional copy may skip straight to the end: closures stay small
        nfa.eps[start].append(end)
        start = _emit(nfa, items, start, False, False)
    nfa.eps[start].append(end)
    return end


def _check_set_syntax(pattern: str) -> None:
    """Rust reads `[` inside a class as a nested class and `&&`, `--`, `~~` as set operations;
    Python reads them as literals, so the two would disagree silently."""
    i, in_class, class_start = 0, False, 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            i += 2
            continue
        if not in_class:
            if ch == "[":
                in_class, class_start = True, i + 1 + (pattern[i + 1:i + 2] == "^")
        elif ch == "]" and i > class_start:
            in_class = False
        elif ch == "[" or (ch in "&-~" and pattern[i + 1:i + 2] == ch):
            raise UnsupportedRegex(f"{pattern!r}: {ch!r} in a character class (Rust set syntax)")
        i += 1


# -- NFA -> DFA -> minimal DFA ---------------------------------------------------------------------

def _coreachable(nfa: _NFA, accept: int) -> set[int]:
    preds: list[list[int]] = [[] for _ in nfa.eps]
    for s, (eps, edges) in enumerate(zip(nfa.eps, nfa.edges)):
        for t in eps + [e[2] for e in edges]:
            preds[t].append(s)
    live, stack = {accept}, [accept]
    while stack:
        for p in preds[stack.pop()]:
            if p not in live:
                live.add(p)
                stack.append(p)
    return live


def _determinize(nfa: _NFA, accept: int, max_states: int, budget: int):
    """Subset construction over byte classes, on the NFA trimmed to states that can still accept
    (so every DFA state is reachable and co-reachable). Returns [S, C] table, accepting, and the
    class of each byte."""
    live = _coreachable(nfa, accept)
    if 0 not in live:
        raise UnsupportedRegex("matches nothing")
    cuts = {0, 256}
    for s in live:
        for lo, hi, t in nfa.edges[s]:
            if t in live:
                cuts.update((lo, hi + 1))
    bounds = sorted(cuts)
    byte_class = (np.searchsorted(bounds, np.arange(256), side="right") - 1).tolist()
    work, raw_cap = 0, _RAW_STATES_PER_STATE * max_states
    steps: dict[int, dict[int, frozenset[int]]] = {}

    def step(s: int) -> dict[int, frozenset[int]]:
        """Byte class -> NFA states one byte from `s`, once per NFA state."""
        if s not in steps:
            by_class: dict[int, frozenset[int]] = {}
            for lo, hi, t in nfa.edges[s]:
                if t in live:
                    one = frozenset((t,))
                    for c in range(byte_class[lo], byte_class[hi] + 1):
                        by_class[c] = by_class[c] | one if c in by_class else one
            steps[s] = by_class
        return steps[s]

    def closure(seeds) -> frozenset[int]:
        """The states reached from `seeds` by epsilons that read a byte or accept; one search
        per set, as a union of per-state closures is quadratic on `(a?){n}`."""
        nonlocal work
        seen, stack = set(seeds), list(seeds)
        while stack:
            for t in nfa.eps[stack.pop()]:
                if t in live and t not in seen:
                    seen.add(t)
                    stack.append(t)
        work += len(seen)
        if work > budget:
            raise UnsupportedRegex(f"DFA would exceed max_states ({max_states})")
        return frozenset(t for t in seen if nfa.edges[t] or t == accept)

    sets = [closure([0])]
    ids: dict[frozenset[int], int] = {sets[0]: 0}
    rows: list[list[int]] = []
    by_targets: dict[frozenset[int], int] = {}  # NFA states after one byte -> DFA state
    while len(rows) < len(sets):
        members = sets[len(rows)]
        if len(members) == 1:
            targets = step(next(iter(members)))
        else:  # sets, then frozen once: growing frozensets one union at a time is quadratic
            merged: dict[int, set[int]] = {}
            for s in members:
                for c, ts in step(s).items():
                    merged.setdefault(c, set()).update(ts)
            targets = {c: frozenset(ts) for c, ts in merged.items()}
        row = [-1] * (len(bounds) - 1)
        for c, key in targets.items():
            if key not in by_targets:
                dstate = closure(key)
                if dstate not in ids:
                    if len(ids) >= raw_cap:
                        raise UnsupportedRegex(f"DFA would exceed max_states ({max_states})")
                    ids[dstate] = len(sets)
                    sets.append(dstate)
                by_targets[key] = ids[dstate]
            row[c] = by_targets[key]
        rows.append(row)
    accepting = np.array([accept in s for s in sets], dtype=bool)
    return np.array(rows, dtype=np.int64).reshape(len(sets), -1), accepting, np.array(byte_class)


def _minimize(table: np.ndarray, accepting: np.ndarray):
    """Hopcroft's partition refinement, O(m log n) where Moore's rounds grow with the depth
    (`a{4000}`). It runs on the partial DFA: missing transitions stay missing, which is exact
    when every initial block starts as a splitter (Valmari & Lehtinen 2008); no state can equal
    the missing dead state, since every state can still accept."""
    src, cls = np.nonzero(table >= 0)
    dst = table[src, cls]
    order = np.argsort(dst, kind="stable")
    first_pred = np.searchsorted(dst[order], np.arange(len(table) + 1)).tolist()
    preds = list(zip(cls[order].tolist(), src[order].tolist()))  # (class, source), by target
    kinds = sorted(set(accepting.tolist()))  # accepting or not, whichever occur
    block_of = [kinds.index(a) for a in accepting.tolist()]
    blocks = [{s for s, b in enumerate(block_of) if b == i} for i in range(len(kinds))]
    waiting = set(range(len(blocks)))
    while waiting:
        into: dict[int, list[int]] = {}  # class -> states whose move on it lands in the splitter
        for t in blocks[waiting.pop()]:
            for c, s in preds[first_pred[t]:first_pred[t + 1]]:
                into.setdefault(c, []).append(s)
        for sources in into.values():
            touched: dict[int, list[int]] = {}
            for s in sources:
                touched.setdefault(block_of[s], []).append(s)
            for y, inside in touched.items():
                if len(inside) == len(blocks[y]):
                    continue
                blocks.append(set(inside))
                blocks[y].difference_update(inside)
                for s in inside:
                    block_of[s] = len(blocks) - 1
                smaller = len(blocks) - 1 if len(inside) <= len(blocks[y]) else y
                waiting.add(len(blocks) - 1 if y in waiting else smaller)
    rep = [min(b) for b in blocks]
    block_arr = np.array(block_of + [-1])  # block_arr[-1]: no transition stays -1
    return block_arr[table[rep]], accepting[rep], block_of[0]


def _bfs_renumber(table: np.ndarray, accepting: np.ndarray, start: int):
    """Number states in breadth-first order from `start`, classes (byte order) ascending."""
    order, queue, rows = {start: 0}, deque([start]), table.tolist()
    while queue:
        for t in rows[queue.popleft()]:
            if t >= 0 and t not in order:
                order[t] = len(order)
                queue.append(t)
    old = np.array(sorted(order, key=order.get))
    perm = np.full(len(table) + 1, -1, dtype=np.int64)
    perm[old] = np.arange(len(old))  # perm[-1] stays -1
    return perm[table[old]], accepting[old]
