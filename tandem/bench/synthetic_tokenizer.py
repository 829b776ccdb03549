"""A tokenizer for random-weight architectures: token i is the word "t<i>", so any id sequence
round-trips through text exactly. Lets text-based peers (TRL) run the same prompts as tandem."""

from __future__ import annotations


def synthetic_tokenizer(vocab_size: int, eos_token_id: int | None = None):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    eos = f"t{eos_token_id if eos_token_id is not None else vocab_size - 1}"
    # whole words only: a special "t2" must not match the start of "t296"
    eos, pad = (AddedToken(w, single_word=True, special=True) for w in (eos, "t0"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad, unk_token=pad)


def ids_to_text(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)
