"""Regex and choice constraints as token automata that step on the device (no host in the loop).

llguidance computes a constrained row's mask on the host from the token sampled last, so a
constrained step waits for its previous step's tokens (a read-back, the grammar's consume and
fill, a copy back) and cannot run in a decode window. A regular language needs none of that: its
byte automaton (`tandem.engine.regex_dfa`) walked over every vocabulary token's bytes from every
state gives a table `next_state[state, token]`, computed once per grammar (outlines' index). On
the device each constrained sample keeps its state in a slot (`FSMStates`); a step masks a row's
logits with its state's allowed tokens and moves the state by the sampled token, two gathers
(`tandem.layers.sampler.GrammarFSM`). So constrained rows decode in windows beside free ones,
at about a free row's cost. The host steps its own copy of the table to see where a sample ends.

End of a sample, as llguidance's matcher: after a token that leaves the grammar complete with
nothing but EOS allowed (`ends`), or after EOS from an accepting state (into `done`, whose row
allows everything, so a window's steps past the end sample freely for nothing).

A grammar is compiled this way only where its table stays small (`MAX_TABLE_BYTES`): others, and
open JSON schemas and Lark grammars, go through llguidance (`EngineConfig.structured_outputs_backend`;
closed JSON schemas arrive as regexes: `tandem.engine.json_schema_regex`).
"""

from __future__ import annotations

import numpy as np
import torch

MAX_TABLE_BYTES = 64 << 20  # a grammar's [states, vocab] int16 table (on the host and the device)


class TokenFSM:
    """A regular constraint over one vocabulary: `next_state[s, t]` (-1: token t refused in state
    s), the state `done` that EOS leads to, and `ends[s]`: a sample ends on entering s."""

    def __init__(self, next_state: np.ndarray, ends: np.ndarray):
        self.next_state = next_state  # [S + 1, V] int16; row `done` = S maps every token to S
        self.ends = ends  # [S + 1] bool
        self.done = next_state.shape[0] - 1
        self._device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def num_states(self) -> int:
        return self.next_state.shape[0]

    def allowed_bitmask(self) -> np.ndarray:
        """[S + 1, ceil(V / 32)] int32, llguidance's layout (bit t % 32 of word t // 32 set where
        token t is allowed). A row allowing nothing (a dead end this vocabulary cannot leave; its
        sample ends on entering it) allows everything instead: no row of logits is all -inf."""
        allowed = self.next_state >= 0
        allowed[~allowed.any(axis=1)] = True
        S, V = allowed.shape
        words = -(-V // 32)
        bits = np.zeros((S, words * 32), dtype=bool)
        bits[:, :V] = allowed
        packed = np.packbits(bits, axis=1, bitorder="little")  # [S, 4 * words] bytes
        return packed.view("<i4").astype(np.int32)

    def device_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(allowed bitmask [S + 1, W] int32, next state [S + 1, V] int16 with refusals -> done)
        on `device`, made once."""
        tables = self._device.get(device)
        if tables is None:
            nxt = np.where(self.next_state < 0, self.done, self.next_state).astype(np.int16)
            tables = (torch.from_numpy(self.allowed_bitmask()).to(device), torch.from_numpy(nxt).to(device))
            self._device[device] = tables
        return tables


class FSMCursor:
    """One sample's place in its grammar, on the host (the device keeps its own, in `slot`)."""

    __slots__ = ("_states", "fsm", "slot", "state")

    def __init__(self, fsm: TokenFSM):
        self.fsm = fsm
        self.state = 0
        self.slot = -1  # its device slot, once `FSMStates.bind` gave it one
        self._states: FSMStates | None = None

    def advance(self, token: int) -> bool:
        """Take a sampled token; True when the sample ends with it (grammar complete, or the token
        refused: the device mask allows neither, so only a row whose mask allowed nothing)."""
        nxt = int(self.fsm.next_state[self.state, token])
        if nxt < 0:
            self.state = self.fsm.done
            return True
        self.state = nxt
        return bool(self.fsm.ends[nxt])

    def tokens_kept(self, tokens: list[int]) -> tuple[int, bool]:
        """A decode window's tokens: how many the sample keeps (through the one that ends it)
        and whether one did."""
        for i, token in enumerate(tokens):
            if self.advance(token):
                return i + 1, True
        return len(tokens), False

    def release(self) -> None:
        """Give the device slot back (the sample finished)."""
        if self._states is not None:
            self._states.release(self.slot)
            self._states, self.slot = None, -1


class FSMStates:
    """The device-resident state of every constrained sample with a token automaton, one int32
    slot each. A slot is taken when its sample first samples (its start state written then, in
    stream order before that step's sampling) and given back when the sample finishes; a step
    still in flight for a finished sample writes its slot before any later step reuses it."""

    def __init__(self, device: torch.device, capacity: int = 256):
        self.device = device
        self.tensor = torch.zeros(capacity, dtype=torch.int32, device=device)
        self._free = list(range(capacity - 1, -1, -1))

    def bind(self, cursors: list[FSMCursor]) -> None:
        """Slots for the cursors that have none, their start state (0) written on the device."""
        fresh = [c for c in cursors if c._states is None]
        if not fresh:
            return
        while len(self._free) < len(fresh):
            self._grow()
        slots = [self._free.pop() for _ in fresh]
        for c, slot in zip(fresh, slots):
            c.slot, c._states = slot, self
        idx = torch.tensor(slots, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self.tensor.index_fill_(0, idx.to(self.device, non_blocking=True), 0)

    def release(self, slot: int) -> None:
        self._free.append(slot)

    @property
    def num_bound(self) -> int:
        return self.tensor.shape[0] - len(self._free)

    def _grow(self) -> None:
        n = self.tensor.shape[0]
        grown = torch.zeros(2 * n, dtype=torch.int32, device=self.device)
        grown[:n].copy_(self.tensor)  # (in stream order: after every step launched so far)
        self.tensor = grown
        self._free = list(range(2 * n - 1, n - 1, -1)) + self._free


class TokenVocabulary:
    """A vocabulary's token bytes as a matrix, built once per engine: the usable tokens (`usable[t]`:
    may appear in text) sorted longest first, each row a token's bytes zero-padded."""

    def __init__(self, token_bytes: list[bytes], usable: np.ndarray):
        self.size = len(token_bytes)
        ids = np.flatnonzero(usable)
        lens = np.array([len(token_bytes[t]) for t in ids], dtype=np.int64)
        order = np.argsort(-lens, kind="stable")
        self.ids, self.lens = ids[order], lens[order]
        width = int(self.lens.max()) if len(ids) else 0
        self.data = np.zeros((len(ids), width), dtype=np.uint8)
        for row, t in enumerate(self.ids.tolist()):
            self.data[row, : self.lens[row]] = np.frombuffer(token_bytes[t], dtype=np.uint8)


def token_transitions(transitions: np.ndarray, vocab: TokenVocabulary) -> np.ndarray:
    """[S, V] int32: the byte automaton's state after each token's bytes from each state (-1: a
    byte has no transition, or the token is not usable). Bytes the automaton treats alike (same
    column) are one class, so tokens spelling the same class sequence (every lowercase word of a
    length, for `[a-z ]*`) are walked once; the walk is vectorised over states and those
    sequences, one position at a time (longest first, so a position's sequences are a prefix)."""
    S = transitions.shape[0]
    dead = S
    columns, byte_class = np.unique(transitions.T, axis=0, return_inverse=True)
    C = columns.shape[0]
    table = np.full((S + 1, C), dead, dtype=np.int32)
    table[:S] = np.where(columns.T < 0, dead, columns.T)
    width = vocab.data.shape[1]
    dtype = np.uint8 if C < 255 else np.uint16
    classes = byte_class.reshape(-1).astype(dtype)[vocab.data]  # [n, width]
    classes[np.arange(width)[None, :] >= vocab.lens[:, None]] = C  # past the end: its own class
    rows = np.ascontiguousarray(classes).view(np.dtype((np.void, width * classes.itemsize)))
    unique, inverse = np.unique(rows.reshape(-1), return_inverse=True)  # (rows as bytes: fast)
    seqs = unique.view(dtype).reshape(-1, width).astype(np.int64)
    seq_lens = (seqs != C).sum(axis=1)
    order = np.argsort(-seq_lens, kind="stable")
    seqs, seq_lens = seqs[order], seq_lens[order]
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    cur = np.broadcast_to(np.arange(S, dtype=np.int32)[:, None], (S, len(seqs))).copy()
    counts = np.searchsorted(-seq_lens, -np.arange(width), side="left")  # sequences longer than p
    for p in range(width):
        n = int(counts[p])
        cur[:, :n] = table[cur[:, :n], seqs[:n, p]]
    out = np.full((S, vocab.size), -1, dtype=np.int32)
    out[:, vocab.ids] = np.where(cur == dead, -1, cur)[:, rank[inverse.reshape(-1)]]
    return out


def compile_token_fsm(pattern: str, vocab: TokenVocabulary, eos_ids: list[int]) -> TokenFSM:
    """The token automaton of `pattern` (full match, as llguidance's regex grammars) over a
    vocabulary. Raises UnsupportedRegex (ValueError) where the pattern has constructs the byte
    compiler lacks or the table would pass MAX_TABLE_BYTES."""
    from tandem.engine.regex_dfa import UnsupportedRegex, compile_regex

    V = vocab.size
    max_states = min(MAX_TABLE_BYTES // (2 * V), np.iinfo(np.int16).max) - 1
    if max_states < 1:
        raise UnsupportedRegex(f"a vocabulary of {V} tokens leaves no room for a state table")
    dfa = compile_regex(pattern, max_states=max_states)
    S = dfa.num_states
    nxt = np.vstack([token_transitions(dfa.transitions, vocab).astype(np.int16),
                     np.full((1, V), S, dtype=np.int16)])  # row S: done, everything -> done
    eos = [t for t in eos_ids if 0 <= t < V]
    accepting = np.append(dfa.accepting, False)
    nxt[np.ix_(np.flatnonzero(accepting), eos)] = S
    text_tokens = nxt[:S].copy()
    text_tokens[:, eos] = -1
    ends = np.append(~(text_tokens >= 0).any(axis=1), True)  # nothing but (maybe) EOS left
    return TokenFSM(nxt, ends)


def vocabulary(ll_tokenizer, vocab_size: int) -> TokenVocabulary:
    """Each token id's bytes as llguidance's tokenizer sees them (so both backends judge text
    alike), keeping those that may appear in text: not special, not empty, inside the tokenizer
    (a model's vocabulary may be padded past it)."""
    n = min(vocab_size, ll_tokenizer.vocab_size)
    token_bytes = [ll_tokenizer.decode_bytes([t]) for t in range(n)] + [b""] * (vocab_size - n)
    usable = np.array([bool(b) for b in token_bytes], dtype=bool)
    for t in range(n):
        if usable[t] and ll_tokenizer.is_special_token(t):
            usable[t] = False
    return TokenVocabulary(token_bytes, usable)
