"""llguidance's view of a Hugging Face tokenizer: each token id's bytes, which every grammar mask
(llguidance's and the token automata's, `tandem.engine.token_fsm.vocabulary`) is computed over.

llguidance reads a tokenizer's vocabulary as GPT-2's byte alphabet (`Ġ` a space, `Ċ` a newline)
only when the tokenizer's decoder is a bare `ByteLevel`; any decoder `Sequence` it reads as
SentencePiece's byte fallback, each token's name taken as its UTF-8 text. transformers 5.17
converts a GGUF's GPT-2-style tokenizer (the embedded SmolLM2's among them) with the decoder
`Sequence[ByteFallback, Fuse, Replace, ByteLevel]`, which decodes as plain `ByteLevel` does; read
that way, the newline token is the two bytes of `Ċ`, a character JSON strings may hold, and the
masks let raw newlines into JSON strings. So a byte-level vocabulary (a `ByteLevel` pre-tokenizer)
whose decoder sequence ends in `ByteLevel` is handed to llguidance with that decoder alone, and
every tokenizer is checked once: a probe text's tokens, as llguidance spells them, must give back
the probe or what the tokenizer decodes them to (the text the outputs will have), or structured
outputs refuse the tokenizer with a clear error instead of masks over the wrong bytes.
"""

from __future__ import annotations

import copy
import json

# newline, tab, quote, backslash, spaces, and characters of two, three and four UTF-8 bytes
# (tokens holding part of a character among them)
PROBE = '{"k": "a\\n"}\n\tx  y\r\n é 中文 🙂 end'


def llguidance_tokenizer(tokenizer, vocab_size: int, eos_token_ids: list[int]):
    """llguidance's `LLTokenizer` over `tokenizer` (a fast Hugging Face tokenizer) with
    `vocab_size` ids; ValueError if its token bytes do not spell what the tokenizer encodes."""
    import llguidance

    eos = sorted(eos_token_ids) or None
    if eos is None and getattr(tokenizer, "eos_token_id", None) is not None:
        eos = [tokenizer.eos_token_id]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"structured_outputs need a fast (Rust) tokenizer; this one is "
                         f"{type(tokenizer).__name__}: load the model's tokenizer.json")
    backend = copy.copy(backend)  # (as llguidance.hf does: no padding or truncation in the copy)
    backend.no_padding()
    backend.no_truncation()
    spec = json.loads(backend.to_str())
    spec["decoder"] = byte_level_decoder(spec) or spec.get("decoder")
    source = json.dumps(spec)
    try:
        try:
            ll = llguidance.LLTokenizer(source, n_vocab=vocab_size, eos_token=eos)
        except TypeError:  # older llguidance (1.6) takes one end-of-sequence token, not a list
            ll = llguidance.LLTokenizer(source, n_vocab=vocab_size, eos_token=eos[0] if eos else None)
    except Exception as e:  # noqa: BLE001 (llguidance's own words on a tokenizer it cannot read)
        raise ValueError(f"structured_outputs: llguidance cannot read this tokenizer: {e}") from None
    check_token_bytes(ll, tokenizer, spec.get("decoder"))
    return ll


def vocabulary_refusal(tokenizer, vocab_size: int) -> str | None:
    """Why structured outputs would refuse `tokenizer` (`llguidance_tokenizer`'s error), or None
    (also without llguidance, which the grammar check reports): for an API server to answer 400
    before a constrained request reaches the engine."""
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return None
    try:
        llguidance_tokenizer(tokenizer, vocab_size, [])
    except ValueError as e:
        return str(e)
    return None


def byte_level_decoder(spec: dict) -> dict | None:
    """The bare `ByteLevel` decoder to read a byte-level vocabulary with, where the tokenizer's
    decoder is a sequence ending in one (None: leave the decoder as it is)."""
    decoder = spec.get("decoder") or {}
    steps = decoder.get("decoders") or []
    if decoder.get("type") != "Sequence" or not steps or steps[-1].get("type") != "ByteLevel":
        return None
    if not _has_byte_level(spec.get("pre_tokenizer")):
        return None  # names not in GPT-2's byte alphabet: not ours to reinterpret
    return steps[-1]


def _has_byte_level(pre_tokenizer: dict | None) -> bool:
    if not pre_tokenizer:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any(_has_byte_level(p) for p in pre_tokenizer.get("pretokenizers") or [])
    return pre_tokenizer.get("type") == "ByteLevel"


def check_token_bytes(ll, tokenizer, decoder: dict | None) -> None:
    """The probe's tokens, as llguidance spells them, must give back the probe's bytes or what
    the tokenizer decodes them to (a normalizer may change the text), after the one space a
    SentencePiece tokenizer prepends."""
    ids = tokenizer.encode(PROBE, add_special_tokens=False)
    got = ll.decode_bytes(ids)
    wants = {PROBE.encode(), tokenizer.decode(ids, skip_special_tokens=False).encode()}
    if got in wants or got.startswith(b" ") and got[1:] in wants:
        return
    kind = (decoder or {}).get("type")
    if kind == "Sequence":
        kind += "[" + ", ".join(str(d.get("type")) for d in decoder.get("decoders") or []) + "]"
    raise ValueError(
        f"structured_outputs: llguidance reads this tokenizer's vocabulary as other bytes than it "
        f"encodes (the probe {PROBE[:12]!r}... comes back as {got[:16]!r}...; the tokenizer's "
        f"decoder: {kind}), so its masks would be over the wrong text; use a tokenizer whose "
        f"decoder is ByteLevel (GPT-2-style vocabularies) or SentencePiece's byte fallback")
