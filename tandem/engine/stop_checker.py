"""Decides when a sequence is done: EOS, stop tokens, stop strings, max_tokens, max_model_len."""

from __future__ import annotations

from tandem.engine.sequence import Sequence


def check_stop(seq: Sequence, eos_token_ids: set[int], max_model_len: int) -> tuple[str, int | None] | None:
    """(finish_reason, stop_reason) once the last sampled token ends the sequence, else None."""
    p = seq.sampling_params
    n_out = seq.num_output_tokens
    token = seq.last_token_id
    if n_out >= p.min_tokens:
        if not p.ignore_eos and token in eos_token_ids:
            return "stop", None
        if token in p.stop_token_ids:
            return "stop", token
    if (p.max_tokens is not None and n_out >= p.max_tokens) or seq.num_tokens >= max_model_len:
        return "length", None
    return None


def find_stop_string(text: str, new_chars: int, stop_strings: list[str]) -> tuple[str, int] | None:
    """The stop string that the last `new_chars` characters completed, and where it starts."""
    for stop in stop_strings:
        start = max(0, len(text) - new_chars - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1:
            return stop, idx
    return None
