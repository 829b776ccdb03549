"""Incremental detokenization: per token or in chunks, the text is the tokenizer's own decode."""

import random

import pytest
from model_fixtures import make_tokenizer

from tandem.engine.detokenizer import IncrementalDetokenizer, batch_decode, rust_backend


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_chunks_give_the_full_decode(tok, chunk):
    """Multi-byte characters split over byte-level tokens are never emitted half-way."""
    prompt = _ids(tok, "Translate: ")
    out = _ids(tok, "héllo wörld — 日本語 ✓ and more plain words")
    det = IncrementalDetokenizer(tok, prompt)
    deltas = [det.add_many(out[i : i + chunk]) for i in range(0, len(out), chunk)]
    deltas.append(det.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == det.text == tok.decode(out)
    assert det.num_added == len(out)


def test_random_ids_chunked_equal_per_token(tok):
    """Arbitrary ids (invalid byte sequences included): chunking changes when text appears, not
    what it is once flushed."""
    rng = random.Random(0)
    out = [rng.randrange(3, len(tok)) for _ in range(200)]
    one = IncrementalDetokenizer(tok, [5, 6])
    for t in out:
        one.add(t)
    one.flush()
    many = IncrementalDetokenizer(tok, [5, 6])
    i = 0
    while i < len(out):
        k = rng.randint(1, 9)
        many.add_many(out[i : i + k])
        i += k
    many.flush()
    assert many.text == one.text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_batch_decode_gives_the_tokenizers_own_texts(tok, skip_special_tokens):
    """Through the Rust backend's batch call (random ids, special tokens and empty rows among
    them); with a cleanup pass configured, through the tokenizer itself, cleanup included."""
    rng = random.Random(0)
    rows = [[rng.randrange(len(tok)) for _ in range(rng.randrange(40))] for _ in range(50)] + [[]]
    assert rust_backend(tok) is not None
    assert batch_decode(tok, rows, skip_special_tokens) == tok.batch_decode(rows, skip_special_tokens=skip_special_tokens)
    tok.clean_up_tokenization_spaces = True
    try:
        assert rust_backend(tok) is None
        assert batch_decode(tok, rows, skip_special_tokens) == tok.batch_decode(
            rows, skip_special_tokens=skip_special_tokens)
    finally:
        tok.clean_up_tokenization_spaces = False
