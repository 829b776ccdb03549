"""Per-step attention metadata, handed to attention layers without threading it through models."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """How the flattened tokens of one step map onto sequences and KV-cache slots."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token (-1: padding)
    query_start_loc: torch.Tensor  # [B+1] int32: cu_seqlens of the queries
    seq_lens: torch.Tensor  # [B] int32: tokens in each sequence's context after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    decode_only: bool
    # Host copies, so the torch backend needs no device sync.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # Decode steps: the sequence each row of decode attention's grid takes (int32 [B]; None: batch
    # order). A CUDA graph's buffer, or made once a step (`TritonAttentionBackend.decode_order`).
    decode_order: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


_context: AttentionMetadata | None = None


def get_attention_metadata() -> AttentionMetadata | None:
    return _context


@contextlib.contextmanager
def set_attention_metadata(meta: AttentionMetadata | None):
    """Scope `meta` to one forward pass; always restored, even on error."""
    global _context
    prev, _context = _context, meta
    try:
        yield
    finally:
        _context = prev
