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


def _metaspace_tokenizer():
    """A SentencePiece-style tokenizer: decoding drops the leading space of its first word."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, "s": 3, "▁a": 4, "b": 5}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>")


@pytest.mark.parametrize("metaspace", [False, True])
def test_delta_text_gives_the_engines_text(tok, metaspace):
    """DeltaText, fed a request's deltas (token ids, text left empty), gives each delta the text
    the engine's detokenizer gives it (prompt context, chunks, held-back bytes, the flush at the
    end), per sample. With a SentencePiece-style decoder the first word keeps its leading space,
    as in the engine."""
    from tandem.engine.detokenizer import DeltaText
    from tandem.outputs import CompletionOutput, RequestOutput

    t = _metaspace_tokenizer() if metaspace else tok
    rng = random.Random(2)
    prompt = [1, 2, 4] if metaspace else _ids(tok, "Say: ")
    samples = {i: [rng.randrange(1, len(t)) for _ in range(30)] for i in range(2)}
    engine = {i: IncrementalDetokenizer(t, prompt) for i in samples}
    if metaspace:
        assert t.decode([1]) == "hello" and IncrementalDetokenizer(t, prompt).add(1) == " hello"
    text = DeltaText(t)
    pos = {i: 0 for i in samples}
    while any(pos[i] < len(s) for i, s in samples.items()):
        outs, want = [], []
        for i, s in samples.items():
            if pos[i] == len(s):
                continue
            ids = s[pos[i] : pos[i] + rng.randint(1, 5)]
            pos[i] += len(ids)
            done = pos[i] == len(s)
            want.append(engine[i].add_many(ids) + (engine[i].flush() if done else ""))
            outs.append(CompletionOutput(i, "", ids, None, None, "length" if done else None))
        out = RequestOutput("r", None, prompt, outs, finished=False)
        text.fill(out)
        assert [c.text for c in out.outputs] == want
    assert all(d.text == engine[i].text for i, d in text.samples.items())
