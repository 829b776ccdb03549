"""The synthetic tokenizer of random-weight benchmarks: any id sequence round-trips through text."""

from tandem.bench.synthetic_tokenizer import ids_to_text, synthetic_tokenizer


def test_ids_round_trip_even_where_a_special_token_starts_a_word():
    tok = synthetic_tokenizer(320, eos_token_id=2)  # "t2" is EOS, "t0" pad: neither may split "t296"
    ids = [296, 178, 2, 0, 20, 200, 319]
    assert tok(ids_to_text(ids), add_special_tokens=False)["input_ids"] == ids
    assert (tok.eos_token_id, tok.pad_token_id) == (2, 0)
    assert tok.decode([296, 2, 5]) == "t296 t2 t5"
