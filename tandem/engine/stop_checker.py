"""Decides when a sequence is done: EOS, stop tokens, stop strings, max_tokens, max_model_len."""

from __future__ import annotations

from tandem.engine.sequence import Sequence


def check_stop(seq: Sequence) -> tuple[str, int | None] | None:
    """(finish_reason, stop_reason) once the last sampled token ends the sequence, else None.

    Reads the limits the engine set on the sequence: `stop_ids` (stop tokens, plus EOS unless
    ignore_eos; EOS reports no stop_reason) and `max_num_tokens` (prompt + max_tokens, capped at
    max_model_len), judged on the tokens read back so far: where stop strings need a decode
    window's tokens taken in one at a time, its later ones still count as placeholders.
    """
    num_tokens = len(seq.token_ids)
    token = seq.token_ids[-1]
    if token in seq.stop_ids and num_tokens - seq.num_prompt_tokens >= seq.sampling_params.min_tokens:
        return "stop", (None if token in seq.eos_ids else token)
    if num_tokens >= seq.max_num_tokens:
        return "length", None
    return None


def window_tokens_kept(seq: Sequence, token_ids: list[int]) -> int:
    """How many of a decode window's tokens the sample keeps: through its first stop token, else
    all. (A window runs only once min_tokens is met, so any stop token ends the sample.)"""
    stop_ids = seq.stop_ids
    if stop_ids:
        for i, token in enumerate(token_ids):
            if token in stop_ids:
                return i + 1
    return len(token_ids)


def find_stop_string(text: str, new_chars: int, stop_strings: list[str]) -> tuple[str, int] | None:
    """The stop string that the last `new_chars` characters completed, and where it starts."""
    for stop in stop_strings:
        start = max(0, len(text) - new_chars - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1:
            return stop, idx
    return None
