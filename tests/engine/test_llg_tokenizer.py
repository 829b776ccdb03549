"""llguidance's view of a tokenizer (`tandem.engine.llg_tokenizer`): the bytes every grammar mask
is computed over. The case that broke on the GPU host: transformers 5.17 converts the embedded
SmolLM2's GGUF tokenizer with the decoder Sequence[ByteFallback, Fuse, Replace, ByteLevel], which
llguidance read as byte fallback, so the newline token was the bytes of "Ċ" and closed-JSON
samples held raw newlines inside their strings."""

import numpy as np
import pytest
from model_fixtures import MISREAD_DECODER, tokenizer_with_decoder

pytest.importorskip("llguidance")

from tandem.engine.llg_tokenizer import PROBE, llguidance_tokenizer

V = 49152  # SmolLM2's vocabulary
NEWLINE = 198  # "Ċ" in GPT-2's byte alphabet
CLOSED = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
          "age": {"type": "integer"}}, "required": ["name", "age"], "additionalProperties": False}


def _tokenizer_with(smollm2_dir, tmp_path, decoder: dict, byte_fallback: bool):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_with_decoder(smollm2_dir, tmp_path, decoder, byte_fallback))


BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
# transformers 5.17's conversion of a GGUF's GPT-2-style tokenizer
GGUF_517 = {"type": "Sequence", "decoders": [
    {"type": "ByteFallback"}, {"type": "Fuse"},
    {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, BYTE_LEVEL]}


@pytest.fixture(scope="module")
def tokenizers(smollm2_dir, tmp_path_factory):
    plain = _tokenizer_with(smollm2_dir, tmp_path_factory.mktemp("plain"), BYTE_LEVEL, False)
    gguf = _tokenizer_with(smollm2_dir, tmp_path_factory.mktemp("gguf517"), GGUF_517, True)
    return plain, gguf


def test_a_byte_level_vocabulary_behind_a_decoder_sequence_keeps_its_bytes(tokenizers):
    """Both tokenizers decode alike; llguidance's view of the 5.17-style one gives every token
    the bytes it has under a bare ByteLevel decoder (the newline a newline, not "Ċ")."""
    plain, gguf = tokenizers
    ids = plain.encode(PROBE, add_special_tokens=False)
    assert gguf.encode(PROBE, add_special_tokens=False) == ids
    assert gguf.decode(ids) == plain.decode(ids) == PROBE
    want = llguidance_tokenizer(plain, V, [plain.eos_token_id])
    got = llguidance_tokenizer(gguf, V, [gguf.eos_token_id])
    assert got.decode_bytes([NEWLINE]) == b"\n"
    assert [got.decode_bytes([t]) for t in range(V)] == [want.decode_bytes([t]) for t in range(V)]


@pytest.mark.parametrize("backend", ["fsm", "guidance"])
def test_a_closed_json_string_refuses_a_raw_newline(tokenizers, backend):
    """The GPU host's failure, on the CPU: inside a JSON string of the closed schema, neither the
    token automaton nor llguidance's matcher allows the newline token (JSON needs it escaped)."""
    from tandem.engine.structured_output import StructuredOutputManager
    from tandem.sampling_params import StructuredOutputsParams

    _, tok = tokenizers
    manager = StructuredOutputManager(tok, V, frozenset([tok.eos_token_id]), backend)
    so = StructuredOutputsParams(json=CLOSED, disable_any_whitespace=True)
    (grammar,) = manager.sample_grammars(so, 1)
    prefix = tok.encode('{"name":"ab', add_special_tokens=False)
    if backend == "fsm":
        for t in prefix:
            assert not grammar.advance(t)
        allowed = grammar.fsm.next_state[grammar.state] >= 0
    else:
        for t in prefix:
            assert grammar.consume_token(t)
        words = np.frombuffer(grammar.compute_bitmask(), dtype=np.int32)
        allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[:V].astype(bool)
    escaped = tok.encode('\\n', add_special_tokens=False)[0]  # the escape's first token
    assert allowed[escaped] and allowed[tok.encode("c", add_special_tokens=False)[0]]
    assert not allowed[NEWLINE]


def test_a_tokenizer_llguidance_misreads_is_refused_and_the_engine_goes_on(smollm2_dir, tmp_path):
    """llguidance's view of the vocabulary would not spell what the tokenizer encodes or decodes
    (the newline), so a constrained request is refused with an error naming the decoder, every
    time, and free requests still run."""
    from tandem import LLM, SamplingParams, StructuredOutputsParams

    bad = _tokenizer_with(smollm2_dir, tmp_path, MISREAD_DECODER, True)
    with pytest.raises(ValueError, match="structured_outputs: llguidance reads this tokenizer"):
        llguidance_tokenizer(bad, V, [bad.eos_token_id])
    llm = LLM(smollm2_dir, tokenizer=bad, max_model_len=128)
    so = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    for _ in range(2):
        with pytest.raises(ValueError, match=r"Sequence\[Replace, ByteFallback, Fuse\]"):
            llm.generate(["Hi"], so, use_tqdm=False)
    (out,) = llm.generate(["Hi"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_tokenizer_llguidance_cannot_read_is_a_value_error(smollm2_dir, tmp_path):
    """No decoder at all: llguidance cannot tell how to read the vocabulary; its own words come
    back as a ValueError (a 400 behind the server), not as whatever it raised."""
    tok = _tokenizer_with(smollm2_dir, tmp_path, None, False)
    with pytest.raises(ValueError, match="structured_outputs: llguidance cannot read this tokenizer"):
        llguidance_tokenizer(tok, V, [tok.eos_token_id])


def test_a_decoder_llguidance_reads_as_the_tokenizer_decodes_is_kept(smollm2_dir, tmp_path):
    """A byte-level vocabulary behind Sequence[ByteFallback, Fuse]: the tokenizer itself decodes
    the newline token as "Ċ", and llguidance reads it so: the masks agree with the text the
    outputs will have, so the tokenizer is kept (only a disagreement is refused)."""
    tok = _tokenizer_with(smollm2_dir, tmp_path, {"type": "Sequence", "decoders": [
        {"type": "ByteFallback"}, {"type": "Fuse"}]}, True)
    assert tok.decode([NEWLINE]) == "\u010a"
    ll = llguidance_tokenizer(tok, V, [tok.eos_token_id])
    assert ll.decode_bytes([NEWLINE]) == "\u010a".encode()
